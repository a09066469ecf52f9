/// The client of a treegraft server's HTTP API: its model, config, status, and answers, streamed or whole.
import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif

/// Talks to one `treegraft serve` (a local one TreegraftServer launched, or any other).
/// Every method that awaits a reply throws a TreegraftError for the server's error replies,
/// and cancelling the calling task cancels the request.
public struct TreegraftClient: Sendable {
    public let baseURL: URL
    private let endpoint: Endpoint
    private let configuration: URLSessionConfiguration

    /// `baseURL` is the server's root (http://127.0.0.1:8080); `apiKey` the server's
    /// --api-key, sent as a bearer token.
    public init(baseURL: URL, apiKey: String? = nil) {
        let configuration = URLSessionConfiguration.ephemeral
        configuration.timeoutIntervalForRequest = 600
        configuration.urlCache = nil
        self.init(baseURL: baseURL, apiKey: apiKey, configuration: configuration)
    }

    /// With a session configuration of one's own (tests: a URLProtocol that replays a stream).
    init(baseURL: URL, apiKey: String?, configuration: URLSessionConfiguration) {
        self.baseURL = baseURL
        endpoint = Endpoint(baseURL: baseURL, apiKey: apiKey)
        self.configuration = configuration
    }

    /// The models the server serves (one).
    public func models() async throws -> [Model] {
        try decode(ModelListWire.self, from: await get("v1/models")).data
    }

    /// The server's defaults: model, strategies, token limits.
    public func config() async throws -> ServerConfig {
        try decode(ServerConfig.self, from: await get("treegraft/config"))
    }

    /// What the server is doing, and what it has served so far.
    public func status() async throws -> ServerStatus {
        try decode(ServerStatus.self, from: await get("treegraft/status"))
    }

    /// Whether the model is loaded (needs no key).
    public func health() async throws -> Health {
        try decode(Health.self, from: await get("health"))
    }

    /// A whole text completion of `prompt` (POST /v1/completions).
    public func complete(prompt: String, options: ChatOptions = ChatOptions()) async throws -> Completion {
        let body = GenerationBody(prompt: prompt, stream: false, options: options)
        return try decode(CompletionWire.self, from: await post("v1/completions", body)).completion
    }

    /// A whole chat answer to `messages` (POST /v1/chat/completions).
    public func chat(messages: [ChatMessage], options: ChatOptions = ChatOptions()) async throws -> Completion {
        let body = GenerationBody(messages: messages, stream: false, options: options)
        return try decode(CompletionWire.self, from: await post("v1/chat/completions", body)).completion
    }

    /// The chat answer to `messages`, chunk by chunk as the server generates it. The stream
    /// ends after the chunk with the finish reason and usage, or throws a TreegraftError
    /// (an error reply, or the server's error event mid-stream).
    public func streamChat(messages: [ChatMessage], options: ChatOptions = ChatOptions()) -> AsyncThrowingStream<ChatChunk, Error> {
        streamed("v1/chat/completions", GenerationBody(messages: messages, stream: true, options: options))
    }

    /// The text completion of `prompt`, chunk by chunk (as streamChat).
    public func streamCompletion(prompt: String, options: ChatOptions = ChatOptions()) -> AsyncThrowingStream<ChatChunk, Error> {
        streamed("v1/completions", GenerationBody(prompt: prompt, stream: true, options: options))
    }

    // MARK: requests

    private func get(_ path: String) async throws -> Data {
        try await withSession { try await send(endpoint.request(path), on: $0) }
    }

    private func post(_ path: String, _ body: GenerationBody) async throws -> Data {
        let request = endpoint.request(path, method: "POST", body: try JSONEncoder().encode(body))
        return try await withSession { try await send(request, on: $0) }
    }

    /// Send a request that carries any bytes (a malformed body, a method of its own) and
    /// return the reply's body; for what the typed methods cannot send.
    public func raw(_ path: String, method: String, body: Data?) async throws -> Data {
        try await withSession { try await send(endpoint.request(path, method: method, body: body), on: $0) }
    }

    private func streamed(_ path: String, _ body: GenerationBody) -> AsyncThrowingStream<ChatChunk, Error> {
        do {
            let data = try JSONEncoder().encode(body)
            return stream(endpoint.request(path, method: "POST", body: data), configuration: configuration)
        } catch {
            return AsyncThrowingStream { $0.finish(throwing: error) }
        }
    }

    /// A session for one exchange, invalidated after it.
    private func withSession(_ body: (URLSession) async throws -> Data) async throws -> Data {
        let session = URLSession(configuration: configuration)
        defer { session.finishTasksAndInvalidate() }
        return try await body(session)
    }
}
