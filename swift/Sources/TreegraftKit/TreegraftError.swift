/// The errors a treegraft server answers with, decoded from its OpenAI-style error JSON.
import Foundation

/// What went wrong with a request to a treegraft server.
public enum TreegraftError: Error, Equatable, Sendable {
    /// 400: the request was malformed or a parameter was out of range.
    case badRequest(String)
    /// 401: the API key was missing or wrong.
    case unauthorized(String)
    /// 404: no such route, or a model the server does not serve.
    case notFound(String)
    /// 413: the request body was larger than the server accepts.
    case payloadTooLarge(String)
    /// 503: the server's queue is full; try again after `retryAfter` seconds.
    case busy(retryAfter: TimeInterval, message: String)
    /// Any other status code the server answered with (e.g. 500).
    case server(status: Int, message: String)
    /// The stream had started when generation failed: the server's error event.
    case streamFailed(code: Int, message: String)
    /// The server sent something that is not what a treegraft server sends.
    case invalidResponse(String)
    /// The connection failed (refused, dropped, timed out).
    case transport(String)
}

/// The body of an OpenAI-style error reply: {"error": {"message", "type", "code"}}.
struct ErrorReply: Decodable {
    struct Detail: Decodable {
        let message: String
        let type: String?
        let code: Int?
    }
    let error: Detail
}

extension TreegraftError {
    /// The error for a non-2xx reply: its status, its Retry-After header, its JSON body.
    static func from(status: Int, retryAfter: String?, body: Data) -> TreegraftError {
        let message = (try? JSONDecoder().decode(ErrorReply.self, from: body))?.error.message
            ?? String(decoding: body.prefix(500), as: UTF8.self)
        switch status {
        case 400: return .badRequest(message)
        case 401: return .unauthorized(message)
        case 404: return .notFound(message)
        case 413: return .payloadTooLarge(message)
        case 503: return .busy(retryAfter: retryAfter.flatMap(TimeInterval.init) ?? 1,
                               message: message)
        default: return .server(status: status, message: message)
        }
    }

    /// The error event that ends a failed stream, or nil when `data` is not one.
    static func streamEvent(_ data: Data) -> TreegraftError? {
        guard let reply = try? JSONDecoder().decode(ErrorReply.self, from: data) else {
            return nil
        }
        return .streamFailed(code: reply.error.code ?? 500, message: reply.error.message)
    }
}
