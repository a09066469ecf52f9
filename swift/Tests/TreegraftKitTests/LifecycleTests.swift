/// TreegraftServer's lifecycle: stop() and release end the process; a dead launcher leaves none.
import XCTest
@testable import TreegraftKit

final class LifecycleTests: XCTestCase {
    private func launch() async throws -> TreegraftServer {
        _ = try await Live.server()     // skips, saying why, without treegraft
        return try await TreegraftServer.launch(arguments: ["--no-autotune"])
    }

    func testStopClosesStdinAndTheProcessExits() async throws {
        let server = try await launch()
        let pid = server.processIdentifier
        let health = try await server.client.health()
        XCTAssertTrue(health.loaded)
        server.stop()
        XCTAssertFalse(server.isRunning)
        XCTAssertTrue(processIsGone(pid))
        XCTAssertEqual(server.exit, .exited(0), "it exited by itself once its stdin closed")
    }

    func testReleasingTheServerStopsIt() async throws {
        var server: TreegraftServer? = try await launch()
        let pid = server!.processIdentifier
        server = nil
        let gone = try await waitGone(pid, seconds: 15)
        XCTAssertTrue(gone)
    }

    func testALauncherWhoseParentDiesLeavesNoServerBehind() async throws {
        _ = try await Live.server()
        let probe = Process()
        probe.executableURL = try Live.product("LaunchProbe")
        let out = Pipe()
        probe.standardOutput = out
        try probe.run()
        let line = String(decoding: readLine(out.fileHandleForReading), as: UTF8.self)
        let pids = line.split(separator: " ").dropFirst().compactMap { Int32($0) }
        XCTAssertTrue(line.hasPrefix("pids ") && pids.count == 2, "the probe said: \(line)")
        kill(probe.processIdentifier, SIGKILL)
        probe.waitUntilExit()
        for pid in pids {
            let gone = try await waitGone(pid)
            XCTAssertTrue(gone, "server \(pid) outlived its launcher")
        }
    }

    /// The first line of `handle` (blocking: the probe prints it once both servers are ready).
    private func readLine(_ handle: FileHandle) -> Data {
        var line = Data()
        while true {
            guard let byte = try? handle.read(upToCount: 1), let first = byte.first else { return line }
            if first == 0x0A { return line }
            line.append(first)
        }
    }
}
