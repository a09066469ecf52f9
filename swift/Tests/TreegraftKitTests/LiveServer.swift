/// The one `treegraft serve` on tg-tiny the integration tests share, and their helpers.
import Foundation
import XCTest
@testable import TreegraftKit

/// The shared server: launched on first use, never released (it exits with the test
/// process, whose end closes its stdin). Two generations run together and none waits, so
/// two long streams fill it (the 503 test).
enum Live {
    static let arguments = ["--no-autotune", "--max-batch", "2", "--max-queue", "0",
                            "--max-tokens-limit", "1024"]
    private static let shared = SharedLaunch()

    /// The shared server, or a skip saying why there is none.
    static func server() async throws -> TreegraftServer {
        guard TreegraftExecutable.locate() != nil else {
            throw XCTSkip("integration tests need treegraft serve: \(TreegraftExecutable.searched())")
        }
        return try await shared.server()
    }

    /// The shared server once nothing runs on it (what an earlier test left has ended).
    static func idleServer() async throws -> TreegraftServer {
        let server = try await server()
        _ = try await waitFor(server.client, "the server to be idle") { !$0.busy && $0.batch == 0 }
        return server
    }

    /// Poll the status until `condition` holds (at most `seconds`); the status that did.
    static func waitFor(_ client: TreegraftClient, _ what: String, seconds: Double = 60,
                        _ condition: (ServerStatus) -> Bool) async throws -> ServerStatus {
        let deadline = Date().addingTimeInterval(seconds)
        while true {
            let status = try await client.status()
            if condition(status) { return status }
            if Date() > deadline { throw TreegraftError.invalidResponse("waited \(seconds) s for \(what): \(status)") }
            try await Task.sleep(nanoseconds: 50_000_000)
        }
    }

    /// A product built beside the test binary (an executable target of the package).
    static func product(_ name: String) throws -> URL {
        let candidates = [URL(fileURLWithPath: CommandLine.arguments[0]).deletingLastPathComponent(),
                          Bundle(for: TestBundleMarker.self).bundleURL.deletingLastPathComponent()]
        for dir in candidates {
            let url = dir.appendingPathComponent(name)
            if FileManager.default.isExecutableFile(atPath: url.path) { return url }
        }
        throw XCTSkip("\(name) was not built beside the tests (looked in \(candidates.map(\.path)))")
    }
}

private final class TestBundleMarker {}

/// Launches the shared server once, whatever the number of tests asking at once.
private actor SharedLaunch {
    private var launch: Task<TreegraftServer, Error>?

    func server() async throws -> TreegraftServer {
        if launch == nil { launch = Task { try await TreegraftServer.launch(arguments: Live.arguments) } }
        return try await launch!.value
    }
}

/// Whether process `pid` is gone (a zombie nobody reaps counts as gone).
func processIsGone(_ pid: Int32) -> Bool {
    if kill(pid, 0) != 0 && errno == ESRCH { return true }
    #if os(Linux)
    if let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
       let close = stat.lastIndex(of: ")") {
        return stat[stat.index(close, offsetBy: 2)] == "Z"
    }
    #endif
    return false
}

/// Wait up to `seconds` for `pid` to be gone.
func waitGone(_ pid: Int32, seconds: Double = 30) async throws -> Bool {
    let deadline = Date().addingTimeInterval(seconds)
    while !processIsGone(pid) {
        if Date() > deadline { return false }
        try await Task.sleep(nanoseconds: 50_000_000)
    }
    return true
}

/// The text of a whole stream, and its chunks.
func collect(_ stream: AsyncThrowingStream<ChatChunk, Error>) async throws -> (String, [ChatChunk]) {
    var chunks: [ChatChunk] = []
    for try await chunk in stream { chunks.append(chunk) }
    return (chunks.map(\.text).joined(), chunks)
}
