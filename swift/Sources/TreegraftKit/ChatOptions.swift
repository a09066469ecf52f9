/// What a request asks for: the conversation, and the generation's options.
import Foundation

/// One message of a conversation.
public struct ChatMessage: Equatable, Sendable, Codable {
    public enum Role: String, Codable, Sendable { case system, user, assistant }
    public let role: Role
    public let content: String

    public init(role: Role, content: String) {
        self.role = role
        self.content = content
    }

    public static func user(_ text: String) -> ChatMessage { ChatMessage(role: .user, content: text) }
    public static func assistant(_ text: String) -> ChatMessage { ChatMessage(role: .assistant, content: text) }
    public static func system(_ text: String) -> ChatMessage { ChatMessage(role: .system, content: text) }
}

/// A generation's options; nil leaves the server's default (GET /treegraft/config).
public struct ChatOptions: Equatable, Sendable, Encodable {
    public var maxTokens: Int?
    public var strategy: String?
    public var temperature: Double?
    public var topP: Double?
    public var topK: Int?
    public var minP: Double?
    public var seed: Int?
    public var stop: [String]?

    public init(maxTokens: Int? = nil, strategy: String? = nil, temperature: Double? = nil,
                topP: Double? = nil, topK: Int? = nil, minP: Double? = nil, seed: Int? = nil,
                stop: [String]? = nil) {
        self.maxTokens = maxTokens
        self.strategy = strategy
        self.temperature = temperature
        self.topP = topP
        self.topK = topK
        self.minP = minP
        self.seed = seed
        self.stop = stop
    }

    enum CodingKeys: String, CodingKey {
        case strategy, temperature, seed, stop
        case maxTokens = "max_tokens", topP = "top_p", topK = "top_k", minP = "min_p"
    }
}

/// The JSON body of a generation request.
struct GenerationBody: Encodable {
    var messages: [ChatMessage]?
    var prompt: String?
    var stream: Bool
    var options: ChatOptions

    enum CodingKeys: String, CodingKey { case messages, prompt, stream }

    func encode(to encoder: Encoder) throws {
        try options.encode(to: encoder)
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encodeIfPresent(messages, forKey: .messages)
        try container.encodeIfPresent(prompt, forKey: .prompt)
        try container.encode(stream, forKey: .stream)
    }
}
