/// Cancelling the consuming task cancels the request, and the server stops that generation.
import XCTest
@testable import TreegraftKit

final class CancelTests: XCTestCase {
    func testCancellingAfterTheFirstChunkEndsTheGenerationOnTheServer() async throws {
        let client = try await Live.idleServer().client
        let before = try await client.status()
        let (firsts, signal) = AsyncStream<Void>.makeStream()
        let stream = client.streamCompletion(prompt: "Once upon a time",
                                             options: ChatOptions(maxTokens: 1024, strategy: "ar"))
        let consumer = Task {
            for try await _ in stream { signal.yield() }
        }
        for await _ in firsts { break }
        consumer.cancel()
        _ = await consumer.result
        let after = try await Live.waitFor(client, "the generation to count as disconnected") {
            $0.disconnected == before.disconnected + 1 && !$0.busy
        }
        try await Task.sleep(nanoseconds: 500_000_000)
        let later = try await client.status()
        XCTAssertEqual(later.steps, after.steps, "steps still grow after the cancel")
        XCTAssertLessThan(after.tokens - before.tokens, 256, "the generation ran on far past the cancel")
    }
}
