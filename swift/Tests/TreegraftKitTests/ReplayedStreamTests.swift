/// The streaming path itself (URLSession, the delegate, the parser) on recorded streams replayed in small pieces.
import XCTest
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
@testable import TreegraftKit

/// Answers every request with a 200 event stream: `Replay.body`, sent 7 bytes at a time.
final class Replay: URLProtocol {
    nonisolated(unsafe) static var body = Data()

    override class func canInit(with request: URLRequest) -> Bool { true }
    override class func canonicalRequest(for request: URLRequest) -> URLRequest { request }

    override func startLoading() {
        let response = HTTPURLResponse(url: request.url!, statusCode: 200, httpVersion: "HTTP/1.1",
                                       headerFields: ["Content-Type": "text/event-stream"])!
        client?.urlProtocol(self, didReceive: response, cacheStoragePolicy: .notAllowed)
        var start = 0
        while start < Self.body.count {
            let end = min(start + 7, Self.body.count)
            client?.urlProtocol(self, didLoad: Self.body.subdata(in: start..<end))
            start = end
        }
        client?.urlProtocolDidFinishLoading(self)
    }

    override func stopLoading() {}
}

final class ReplayedStreamTests: XCTestCase {
    private func client(replaying text: String) -> TreegraftClient {
        Replay.body = Data(text.utf8)
        let configuration = URLSessionConfiguration.ephemeral
        configuration.protocolClasses = [Replay.self]
        return TreegraftClient(baseURL: URL(string: "http://replay.invalid")!, apiKey: nil,
                               configuration: configuration)
    }

    func testARecordedChatStreamArrivesWhole() async throws {
        let (text, chunks) = try await collect(client(replaying: Recorded.chat).streamChat(messages: [.user("hi")]))
        XCTAssertEqual(text, "#é漢🙂\n\n#")
        XCTAssertEqual(chunks.map(\.tokens), [1, 3, 5])
    }

    func testTheErrorEventFailsTheStreamAfterItsChunks() async throws {
        var texts: [String] = []
        do {
            for try await chunk in client(replaying: Recorded.failing).streamChat(messages: [.user("hi")]) {
                texts.append(chunk.text)
            }
            XCTFail("the stream ended without its error")
        } catch {
            XCTAssertEqual(error as? TreegraftError,
                           .streamFailed(code: 500, message: "generation failed: RuntimeError: device lost"))
        }
        XCTAssertEqual(texts, ["ab"])
    }

    func testAStreamCutBeforeDoneIsAnError() async throws {
        let cut = String(Recorded.chat.prefix(while: { $0 != "é" }))
        do {
            _ = try await collect(client(replaying: cut).streamChat(messages: [.user("hi")]))
            XCTFail("a stream cut short ended as if whole")
        } catch {
            guard case .invalidResponse = error as? TreegraftError else { return XCTFail("got \(error)") }
        }
    }
}
