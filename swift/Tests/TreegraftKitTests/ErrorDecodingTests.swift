/// Error replies decode to typed errors; the ready line and the executable search parse right.
import XCTest
@testable import TreegraftKit

final class ErrorDecodingTests: XCTestCase {
    private func body(_ message: String, _ code: Int) -> Data {
        Data(#"{"error": {"message": "\#(message)", "type": "t", "code": \#(code)}}"#.utf8)
    }

    func testStatusCodesMapToTheirErrors() {
        XCTAssertEqual(TreegraftError.from(status: 400, retryAfter: nil, body: body("bad", 400)), .badRequest("bad"))
        XCTAssertEqual(TreegraftError.from(status: 401, retryAfter: nil, body: body("key", 401)), .unauthorized("key"))
        XCTAssertEqual(TreegraftError.from(status: 404, retryAfter: nil, body: body("none", 404)), .notFound("none"))
        XCTAssertEqual(TreegraftError.from(status: 413, retryAfter: nil, body: body("big", 413)), .payloadTooLarge("big"))
        XCTAssertEqual(TreegraftError.from(status: 503, retryAfter: "7", body: body("busy", 503)),
                       .busy(retryAfter: 7, message: "busy"))
        XCTAssertEqual(TreegraftError.from(status: 500, retryAfter: nil, body: Data("oops".utf8)),
                       .server(status: 500, message: "oops"))
    }

    func testTheReadyLineGivesTheURL() {
        let line = ReadyLine("serving tg-tiny (treegraft) on http://127.0.0.1:40123\n")
        XCTAssertEqual(line?.url.port, 40123)
        XCTAssertEqual(line?.model, "tg-tiny")
        XCTAssertEqual(line?.strategy, "treegraft")
        XCTAssertNil(ReadyLine("tg-tiny is a small test model bundled with treegraft"))
        XCTAssertNil(ReadyLine("serving tg-tiny (treegraft) on http://127.0.0.1"))
    }

    func testTheExecutableIsFoundByTreegraftBinThenPath() throws {
        let dir = FileManager.default.temporaryDirectory.appendingPathComponent("tgkit-\(UUID())")
        try FileManager.default.createDirectory(at: dir, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: dir) }
        let exe = dir.appendingPathComponent("treegraft")
        XCTAssertTrue(FileManager.default.createFile(atPath: exe.path, contents: Data("#!/bin/sh\n".utf8),
                                       attributes: [.posixPermissions: 0o755]))
        XCTAssertEqual(TreegraftExecutable.locate(environment: ["PATH": "/nonexistent:\(dir.path)"])?.path, exe.path)
        XCTAssertNil(TreegraftExecutable.locate(environment: ["PATH": "/nonexistent"]))
        XCTAssertNil(TreegraftExecutable.locate(environment: ["TREEGRAFT_BIN": "/nonexistent/treegraft", "PATH": dir.path]))
        XCTAssertEqual(TreegraftExecutable.locate(environment: ["TREEGRAFT_BIN": exe.path])?.path, exe.path)
    }
}
