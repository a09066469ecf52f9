/// Reading a child process's stderr line by line on a thread of its own, until it closes.
import Foundation

/// Drains a pipe (so the child never blocks on a full one), keeps its last lines for error
/// messages, and reports the ready line once.
final class OutputLines: @unchecked Sendable {
    private let lock = NSLock()
    private var tail: [String] = []
    private var ready: ReadyLine?
    private var closed = false
    private let keep = 40

    /// Start reading `handle` until its end.
    init(_ handle: FileHandle) {
        let thread = Thread { [self] in read(handle) }
        thread.name = "treegraft-stderr"
        thread.start()
    }

    /// The ready line, once it came.
    var readyLine: ReadyLine? { lock.withLock { ready } }

    /// Whether the pipe reached its end (the process closed it, or exited).
    var isClosed: Bool { lock.withLock { closed } }

    /// The last lines read, joined.
    var text: String { lock.withLock { tail.joined(separator: "\n") } }

    private func read(_ handle: FileHandle) {
        var pending = Data()
        while true {
            let data = handle.availableData
            if data.isEmpty { break }
            pending.append(data)
            while let newline = pending.firstIndex(of: 0x0A) {
                take(String(decoding: pending[pending.startIndex..<newline], as: UTF8.self))
                pending = Data(pending[(newline + 1)...])
            }
        }
        if !pending.isEmpty { take(String(decoding: pending, as: UTF8.self)) }
        lock.withLock { closed = true }
    }

    private func take(_ line: String) {
        lock.withLock {
            tail.append(line)
            if tail.count > keep { tail.removeFirst() }
            if ready == nil { ready = ReadyLine(line) }
        }
    }
}
