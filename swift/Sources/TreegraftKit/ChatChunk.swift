/// A streamed piece of an answer: its text, where each part of it came from, and the counts.
import Foundation

/// Who produced a token: the target model itself, or an accepted draft of the n-gram
/// drafter, of the small drafter model, or of both (the server's names in `rawValue`).
public enum Source: String, Codable, Sendable, CaseIterable {
    case target
    case ngram
    case drafter = "draft"
    case both
}

/// A run of text that came from one source.
public struct ProvenanceRun: Equatable, Sendable, Decodable {
    public let text: String
    public let source: Source

    public init(text: String, source: Source) {
        self.text = text
        self.source = source
    }

    /// The server sends a run as a two-element array: [text, source].
    public init(from decoder: Decoder) throws {
        var pair = try decoder.unkeyedContainer()
        text = try pair.decode(String.self)
        source = try pair.decode(Source.self)
    }
}

/// One chunk of a streamed answer. `provenance` concatenates to `text`; `tokens` and
/// `steps` count the whole generation so far (target forwards in `steps`); the last chunk
/// has a `finishReason` and the `usage`.
public struct ChatChunk: Equatable, Sendable {
    public let text: String
    public let provenance: [ProvenanceRun]
    public let tokens: Int
    public let steps: Int
    public let finishReason: String?
    public let usage: Usage?
}

/// OpenAI's usage block, with the speculation statistics beside it.
public struct Usage: Equatable, Sendable, Decodable {
    public let promptTokens: Int
    public let completionTokens: Int
    public let totalTokens: Int
    public let speculative: Speculative

    enum CodingKeys: String, CodingKey {
        case promptTokens = "prompt_tokens", completionTokens = "completion_tokens"
        case totalTokens = "total_tokens", speculative
    }
}

/// How the speculation went: target forwards, tokens accepted per forward, speed, and the
/// small drafter's calls.
public struct Speculative: Equatable, Sendable, Decodable {
    public let steps: Int
    public let meanAccepted: Double
    public let tokensPerSec: Double
    public let drafterCalls: Int
    public let strategy: String

    enum CodingKeys: String, CodingKey {
        case steps, strategy, meanAccepted = "mean_accepted"
        case tokensPerSec = "tokens_per_sec", drafterCalls = "drafter_calls"
    }
}
