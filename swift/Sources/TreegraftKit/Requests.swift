/// Building a request to the server and sending one whose whole reply is awaited.
import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif

/// Where requests go and the key they carry.
struct Endpoint: Sendable {
    let baseURL: URL
    let apiKey: String?

    func request(_ path: String, method: String = "GET", body: Data? = nil) -> URLRequest {
        var request = URLRequest(url: baseURL.appendingPathComponent(path))
        request.httpMethod = method
        request.timeoutInterval = 600
        if let apiKey { request.setValue("Bearer \(apiKey)", forHTTPHeaderField: "Authorization") }
        if let body {
            request.httpBody = body
            request.setValue("application/json", forHTTPHeaderField: "Content-Type")
        }
        return request
    }
}

/// Send `request` and return its body when the status is 2xx; the server's error otherwise.
/// Cancelling the calling task cancels the request.
func send(_ request: URLRequest, on session: URLSession) async throws -> Data {
    let box = TaskBox()
    return try await withTaskCancellationHandler {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Data, Error>) in
            let task = session.dataTask(with: request) { data, response, error in
                continuation.resume(with: outcome(data: data, response: response, error: error))
            }
            box.set(task)
            task.resume()
        }
    } onCancel: {
        box.cancel()
    }
}

/// The body of a finished exchange, or the error it amounts to.
func outcome(data: Data?, response: URLResponse?, error: Error?) -> Result<Data, Error> {
    if let error { return .failure(transportError(error)) }
    guard let http = response as? HTTPURLResponse else {
        return .failure(TreegraftError.invalidResponse("not an HTTP reply"))
    }
    let body = data ?? Data()
    guard (200..<300).contains(http.statusCode) else {
        return .failure(TreegraftError.from(status: http.statusCode,
                                             retryAfter: http.value(forHTTPHeaderField: "Retry-After"),
                                             body: body))
    }
    return .success(body)
}

/// A URLSession failure as a TreegraftError (cancellation stays CancellationError).
func transportError(_ error: Error) -> Error {
    if (error as? URLError)?.code == .cancelled { return CancellationError() }
    return TreegraftError.transport(error.localizedDescription)
}

/// Decode a reply body, naming what failed.
func decode<T: Decodable>(_ type: T.Type, from data: Data) throws -> T {
    do {
        return try JSONDecoder().decode(type, from: data)
    } catch {
        throw TreegraftError.invalidResponse("undecodable \(type): \(error)")
    }
}

/// The data task of a request, for a cancellation that may come before it exists.
final class TaskBox: @unchecked Sendable {
    private let lock = NSLock()
    private var task: URLSessionTask?
    private var cancelled = false

    func set(_ task: URLSessionTask) {
        lock.lock()
        self.task = task
        let cancel = cancelled
        lock.unlock()
        if cancel { task.cancel() }
    }

    func cancel() {
        lock.lock()
        cancelled = true
        let task = self.task
        lock.unlock()
        task?.cancel()
    }
}
