/// A child process whose standard input is a pipe only it reads, stopped when released.
import Foundation

/// Owns a launched process. The parent holds the write end of the child's stdin: closing it
/// (stop, or the parent's death, which closes it by itself) tells a `serve
/// --exit-on-stdin-close` to exit. stop() waits for the exit, and ends the process
/// with SIGTERM, then SIGKILL, if it does not go in time.
final class ChildProcess: @unchecked Sendable {
    let process: Process
    private let input: Pipe
    private let lock = NSLock()
    private var stopped = false

    init(_ process: Process, input: Pipe) {
        self.process = process
        self.input = input
    }

    deinit { stop() }

    var isRunning: Bool { process.isRunning }

    /// Close stdin, wait up to `grace` seconds for the exit, then terminate it.
    func stop(grace: TimeInterval = 10) {
        let first = lock.withLock { () -> Bool in
            defer { stopped = true }
            return !stopped
        }
        if first { try? input.fileHandleForWriting.close() }
        if wait(grace) { return }
        process.terminate()
        if wait(5) { return }
        kill(process.processIdentifier, SIGKILL)
        _ = wait(5)
    }

    /// Whether the process exited within `seconds`.
    private func wait(_ seconds: TimeInterval) -> Bool {
        let deadline = Date().addingTimeInterval(seconds)
        while process.isRunning && Date() < deadline { Thread.sleep(forTimeInterval: 0.02) }
        return !process.isRunning
    }
}
