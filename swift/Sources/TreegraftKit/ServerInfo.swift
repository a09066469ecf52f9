/// What the server reports about itself: its model, its defaults, its load, its health.
import Foundation

/// A non-streamed answer.
public struct Completion: Equatable, Sendable {
    public let id: String
    public let text: String
    public let finishReason: String?
    public let usage: Usage
}

/// A model the server serves (GET /v1/models).
public struct Model: Equatable, Sendable, Decodable {
    public let id: String
    public let ownedBy: String?
    enum CodingKeys: String, CodingKey { case id, ownedBy = "owned_by" }
}

/// The server's defaults (GET /treegraft/config).
public struct ServerConfig: Equatable, Sendable, Decodable {
    public let model: String
    public let note: String?
    public let strategy: String
    public let strategies: [String]
    public let maxTokens: Int
    public let maxTokensLimit: Int
    public let temperature: Double
    public let topP: Double
    public let apiKeyRequired: Bool

    enum CodingKeys: String, CodingKey {
        case model, note, strategy, strategies, temperature
        case maxTokens = "max_tokens", maxTokensLimit = "max_tokens_limit"
        case topP = "top_p", apiKeyRequired = "api_key_required"
    }
}

/// What the server is doing (GET /treegraft/status): generations running (`batch`) and
/// waiting, steps and tokens served so far (growing while generations run), and how many
/// generations ended by each finish reason ("disconnected": the client went away).
public struct ServerStatus: Equatable, Sendable, Decodable {
    public let busy: Bool
    public let batch: Int
    public let queued: Int
    public let maxBatch: Int
    public let steps: Int
    public let tokens: Int
    public let finished: [String: Int]

    /// Generations that ended because their client went away (or cancelled).
    public var disconnected: Int { finished["disconnected"] ?? 0 }

    enum CodingKeys: String, CodingKey {
        case busy, batch, queued, steps, tokens, finished, maxBatch = "max_batch"
    }
}

/// GET /health (no key needed): whether the model is loaded.
public struct Health: Equatable, Sendable, Decodable {
    public let status: String
    public let loaded: Bool
    public let model: String
}
