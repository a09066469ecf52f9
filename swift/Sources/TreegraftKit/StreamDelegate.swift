/// Streams a reply's server-sent events from a URLSessionDataDelegate into an AsyncThrowingStream.
import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif

/// The delegate of one streamed request: feeds the bytes to an SSEParser and yields each
/// chunk; [DONE] finishes the stream, an error event or a non-2xx reply fails it. Its state
/// is touched only on its session's serial delegate queue.
final class StreamDelegate: NSObject, URLSessionDataDelegate, @unchecked Sendable {
    private let continuation: AsyncThrowingStream<ChatChunk, Error>.Continuation
    private var parser = SSEParser()
    private var status = 0
    private var retryAfter: String?
    private var errorBody = Data()
    private var ended = false

    init(_ continuation: AsyncThrowingStream<ChatChunk, Error>.Continuation) {
        self.continuation = continuation
    }

    func urlSession(_ session: URLSession, dataTask: URLSessionDataTask,
                    didReceive response: URLResponse,
                    completionHandler: @escaping (URLSession.ResponseDisposition) -> Void) {
        let http = response as? HTTPURLResponse
        status = http?.statusCode ?? 0
        retryAfter = http?.value(forHTTPHeaderField: "Retry-After")
        completionHandler(.allow)
    }

    func urlSession(_ session: URLSession, dataTask: URLSessionDataTask, didReceive data: Data) {
        guard !ended else { return }
        guard (200..<300).contains(status) else { errorBody.append(data); return }
        for event in parser.feed(data) { handle(event, task: dataTask) }
    }

    func urlSession(_ session: URLSession, task: URLSessionTask, didCompleteWithError error: Error?) {
        defer { session.finishTasksAndInvalidate() }
        guard !ended else { return }
        if let error { return end(throwing: transportError(error)) }
        if !(200..<300).contains(status) {
            return end(throwing: TreegraftError.from(status: status, retryAfter: retryAfter,
                                                     body: errorBody))
        }
        if let last = parser.finish() { handle(last, task: task) }
        if !ended { end(throwing: TreegraftError.invalidResponse("the stream ended before [DONE]")) }
    }

    /// One event: a chunk, the end ([DONE]), or a failure (which cancels the request).
    private func handle(_ event: SSEEvent, task: URLSessionTask) {
        guard !ended else { return }
        do {
            guard let chunk = try interpret(event) else { return end(throwing: nil) }
            continuation.yield(chunk)
        } catch {
            end(throwing: error)
            task.cancel()
        }
    }

    private func end(throwing error: Error?) {
        ended = true
        continuation.finish(throwing: error)
    }
}

/// What one event of a stream means: a chunk, or nil for its end ([DONE]); the server's
/// error event throws TreegraftError.streamFailed, anything undecodable invalidResponse.
func interpret(_ event: SSEEvent) throws -> ChatChunk? {
    if event.data == "[DONE]" { return nil }
    let data = Data(event.data.utf8)
    if let failure = TreegraftError.streamEvent(data) { throw failure }
    return try decode(StreamChunkWire.self, from: data).chunk
}

/// Start a streamed request: chunks arrive as the server sends them. When the consumer
/// stops (its task cancelled, or it leaves the loop), the request is cancelled and the
/// server ends that generation at its next step.
func stream(_ request: URLRequest, configuration: URLSessionConfiguration) -> AsyncThrowingStream<ChatChunk, Error> {
    AsyncThrowingStream { continuation in
        let queue = OperationQueue()
        queue.maxConcurrentOperationCount = 1
        let session = URLSession(configuration: configuration,
                                 delegate: StreamDelegate(continuation), delegateQueue: queue)
        let task = session.dataTask(with: request)
        continuation.onTermination = { termination in
            if case .cancelled = termination { task.cancel() }
        }
        task.resume()
    }
}
