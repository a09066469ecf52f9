/// Streamed answers from a real server: equal to the whole answer, their provenance, concurrency.
import XCTest
@testable import TreegraftKit

final class StreamingTests: XCTestCase {
    static let greedy = ChatOptions(maxTokens: 24, temperature: 0)
    static let repetitive = String(repeating: "a = 1\nb = 2\n", count: 8)

    func testStreamedTextEqualsTheWholeAnswer() async throws {
        let client = try await Live.idleServer().client
        let messages = [ChatMessage.user("Write a function that parses a header line.")]
        let whole = try await client.chat(messages: messages, options: Self.greedy)
        let (text, chunks) = try await collect(client.streamChat(messages: messages, options: Self.greedy))
        XCTAssertFalse(text.isEmpty)
        XCTAssertEqual(text, whole.text)
        XCTAssertEqual(chunks.last?.usage?.completionTokens, whole.usage.completionTokens)
        checkCounts(chunks)
    }

    func testProvenanceRunsMakeUpEachChunkAndNameTheDrafters() async throws {
        let client = try await Live.idleServer().client
        let options = ChatOptions(maxTokens: 24, strategy: "ngram", temperature: 0)
        let (_, chunks) = try await collect(client.streamCompletion(prompt: Self.repetitive, options: options))
        for chunk in chunks {
            XCTAssertEqual(chunk.provenance.map(\.text).joined(), chunk.text)
        }
        let sources = Set(chunks.flatMap { $0.provenance.map(\.source) })
        XCTAssertEqual(sources, [.target, .ngram], "the n-gram drafter's accepted drafts are named")
        checkCounts(chunks)
    }

    func testTwoConcurrentStreamsEqualTheSerialAnswers() async throws {
        let client = try await Live.idleServer().client
        let a = [ChatMessage.user("Tell me about rivers.")], b = [ChatMessage.user("def parse(text):")]
        let serialA = try await collect(client.streamChat(messages: a, options: Self.greedy)).0
        let serialB = try await collect(client.streamChat(messages: b, options: Self.greedy)).0
        async let togetherA = collect(client.streamChat(messages: a, options: Self.greedy))
        async let togetherB = collect(client.streamChat(messages: b, options: Self.greedy))
        let (ra, rb) = try await (togetherA.0, togetherB.0)
        XCTAssertNotEqual(serialA, serialB)
        XCTAssertEqual(ra, serialA)
        XCTAssertEqual(rb, serialB)
    }

    func testModelsConfigAndHealth() async throws {
        let client = try await Live.idleServer().client
        let models = try await client.models()
        XCTAssertEqual(models.map(\.id), ["tg-tiny"])
        let config = try await client.config()
        XCTAssertEqual(config.maxTokensLimit, 1024)
        XCTAssertTrue(config.apiKeyRequired)
        let health = try await client.health()
        XCTAssertTrue(health.loaded)
    }

    /// Token counts never decrease; only the last chunk ends, with usage matching its counts.
    private func checkCounts(_ chunks: [ChatChunk], file: StaticString = #filePath, line: UInt = #line) {
        let tokens = chunks.map(\.tokens)
        XCTAssertEqual(tokens, tokens.sorted(), file: file, line: line)
        XCTAssertEqual(chunks.filter { $0.finishReason != nil }.count, 1, file: file, line: line)
        guard let last = chunks.last, let usage = last.usage else {
            return XCTFail("the last chunk has no usage", file: file, line: line)
        }
        XCTAssertEqual(usage.completionTokens, last.tokens, file: file, line: line)
        XCTAssertEqual(usage.speculative.steps, last.steps, file: file, line: line)
    }
}
