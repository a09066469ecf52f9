/// A real server's error replies arrive as typed errors: 401, 400, 404, 413, 503 with its delay.
import XCTest
@testable import TreegraftKit

final class ErrorReplyTests: XCTestCase {
    private func expect(_ expected: (TreegraftError) -> Bool, _ what: String,
                        _ body: () async throws -> Void) async {
        do {
            try await body()
            XCTFail("expected \(what), got a reply")
        } catch let error as TreegraftError {
            XCTAssertTrue(expected(error), "expected \(what), got \(error)")
        } catch {
            XCTFail("expected \(what), got \(error)")
        }
    }

    func testAMissingOrWrongKeyIs401() async throws {
        let server = try await Live.idleServer()
        for key in [nil, "wrong"] {
            let client = TreegraftClient(baseURL: server.baseURL, apiKey: key)
            await expect({ if case .unauthorized = $0 { true } else { false } }, "401") {
                _ = try await client.status()
            }
        }
    }

    func testAMalformedBodyIs400AndAnUnknownRouteIs404() async throws {
        let client = try await Live.idleServer().client
        await expect({ if case .badRequest(let m) = $0 { m.contains("malformed JSON") } else { false } }, "400") {
            _ = try await client.raw("v1/chat/completions", method: "POST", body: Data("{not json".utf8))
        }
        await expect({ if case .badRequest(let m) = $0 { m.contains("max_tokens") } else { false } }, "400") {
            _ = try await client.chat(messages: [.user("hi")], options: ChatOptions(maxTokens: 0))
        }
        await expect({ if case .notFound = $0 { true } else { false } }, "404") {
            _ = try await client.raw("v1/nothing", method: "GET", body: nil)
        }
        await expect({ if case .payloadTooLarge = $0 { true } else { false } }, "413") {
            _ = try await client.raw("v1/completions", method: "POST", body: Data(count: (1 << 20) + 1))
        }
    }

    func testAFullServerAnswers503WithItsRetryDelay() async throws {
        let client = try await Live.idleServer().client
        let long = ChatOptions(maxTokens: 1024, strategy: "ar")
        let streams = (0..<2).map { _ in
            Task { for try await _ in client.streamCompletion(prompt: "Once upon a time", options: long) {} }
        }
        defer { streams.forEach { $0.cancel() } }
        _ = try await Live.waitFor(client, "two generations to run") { $0.batch == 2 }
        await expect({ if case .busy(let delay, let m) = $0 { delay == 1 && m.contains("busy") } else { false } }, "503") {
            _ = try await client.complete(prompt: "x", options: ChatOptions(maxTokens: 2))
        }
        await expect({ if case .busy(retryAfter: 1, _) = $0 { true } else { false } }, "503 streamed") {
            _ = try await collect(client.streamChat(messages: [.user("x")], options: ChatOptions(maxTokens: 2)))
        }
    }
}
