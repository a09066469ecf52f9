/// The SSE parser and the stream's events, fed recorded streams split at every byte offset.
import XCTest
@testable import TreegraftKit

final class SSEParserTests: XCTestCase {
    /// All events of `bytes` fed in the pieces `cuts` makes.
    private func parse(_ bytes: [UInt8], cuts: [Int]) -> [SSEEvent] {
        var parser = SSEParser()
        var events: [SSEEvent] = []
        var start = 0
        for cut in cuts + [bytes.count] {
            events += parser.feed(bytes[start..<cut])
            start = cut
        }
        if let last = parser.finish() { events.append(last) }
        return events
    }

    func testEveryOneCutGivesTheSameEvents() throws {
        for stream in [Recorded.chat, Recorded.failing] {
            let bytes = Array(stream.utf8)
            let whole = parse(bytes, cuts: [])
            for cut in 0...bytes.count {
                XCTAssertEqual(parse(bytes, cuts: [cut]), whole, "cut at byte \(cut)")
            }
            XCTAssertEqual(parse(bytes, cuts: Array(1..<bytes.count)), whole, "byte by byte")
        }
    }

    func testTheChatStreamsEventsAndChunks() throws {
        let events = parse(Array(Recorded.chat.utf8), cuts: [])
        XCTAssertEqual(events.count, 4)
        XCTAssertEqual(events.last?.data, "[DONE]")
        let chunks = try events.compactMap(interpret)
        XCTAssertEqual(chunks.map(\.text), ["#", "é漢🙂\n", "\n#"])
        XCTAssertEqual(chunks[1].provenance, [ProvenanceRun(text: "é漢", source: .ngram),
                                              ProvenanceRun(text: "🙂", source: .both),
                                              ProvenanceRun(text: "\n", source: .target)])
        XCTAssertEqual(chunks[2].provenance.first?.source, .drafter)
        XCTAssertEqual(chunks.map(\.tokens), [1, 3, 5])
        XCTAssertEqual(chunks.last?.finishReason, "length")
        XCTAssertEqual(chunks.last?.usage?.speculative.drafterCalls, 8)
        XCTAssertNil(chunks.first?.usage)
    }

    func testTheErrorEventEndsTheStreamWithItsError() throws {
        let events = parse(Array(Recorded.failing.utf8), cuts: [])
        XCTAssertEqual(try interpret(events[0])?.text, "ab")
        XCTAssertThrowsError(try interpret(events[1])) { error in
            XCTAssertEqual(error as? TreegraftError,
                           .streamFailed(code: 500, message: "generation failed: RuntimeError: device lost"))
        }
    }

    func testDataLinesJoinAndAFinalEventNeedsNoBlankLine() {
        XCTAssertEqual(parse(Array("event: x\ndata: a\ndata:b\r\rdata: c".utf8), cuts: []),
                       [SSEEvent(event: "x", data: "a\nb"), SSEEvent(data: "c")])
    }

    func testAnUnknownSourceIsRefused() {
        let event = SSEEvent(data: #"{"choices": [{"text": "a", "finish_reason": null}], "treegraft": {"provenance": [["a", "oracle"]], "tokens": 1, "steps": 0}}"#)
        XCTAssertThrowsError(try interpret(event)) { error in
            guard case .invalidResponse = error as? TreegraftError else {
                return XCTFail("expected invalidResponse, got \(error)")
            }
        }
    }
}
