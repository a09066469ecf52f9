/// An incremental parser of server-sent events: bytes in, in pieces of any size, events out.
import Foundation

/// One server-sent event: its `data` lines joined by "\n", and its `event` name if any.
public struct SSEEvent: Equatable, Sendable {
    public var event: String?
    public var data: String

    public init(event: String? = nil, data: String) {
        self.event = event
        self.data = data
    }
}

/// Splits a byte stream into events as the bytes arrive. Lines end in LF, CRLF or CR (a CR
/// at the end of a piece waits for the next one, which may start with its LF); a line is
/// decoded only once whole, so a UTF-8 character split between pieces arrives intact.
public struct SSEParser: Sendable {
    private var pending: [UInt8] = []
    private var data: [String] = []
    private var event: String?

    public init() {}

    /// The events completed by `bytes`.
    public mutating func feed<Bytes: Sequence>(_ bytes: Bytes) -> [SSEEvent] where Bytes.Element == UInt8 {
        pending.append(contentsOf: bytes)
        var events: [SSEEvent] = []
        var start = 0
        var i = 0
        while i < pending.count {
            let byte = pending[i]
            guard byte == 0x0A || byte == 0x0D else { i += 1; continue }
            if byte == 0x0D && i + 1 == pending.count { break }  // its LF may come next
            let line = String(decoding: pending[start..<i], as: UTF8.self)
            i += (byte == 0x0D && pending[i + 1] == 0x0A) ? 2 : 1
            start = i
            if let done = take(line) { events.append(done) }
        }
        pending.removeFirst(start)
        return events
    }

    /// The last event, when the stream ends without the blank line that would end it.
    public mutating func finish() -> SSEEvent? {
        var last: SSEEvent?
        if !pending.isEmpty {
            let line = String(decoding: pending.filter { $0 != 0x0D }, as: UTF8.self)
            pending = []
            last = take(line)
        }
        return last ?? take("")
    }

    /// Handle one line; returns the event a blank line completes.
    private mutating func take(_ line: String) -> SSEEvent? {
        if line.isEmpty {
            defer { data = []; event = nil }
            return data.isEmpty ? nil : SSEEvent(event: event, data: data.joined(separator: "\n"))
        }
        if line.hasPrefix(":") { return nil }                      // a comment
        let (field, value) = split(line)
        if field == "data" { data.append(value) }
        if field == "event" { event = value }
        return nil
    }

    private func split(_ line: String) -> (String, String) {
        guard let colon = line.firstIndex(of: ":") else { return (line, "") }
        var value = line[line.index(after: colon)...]
        if value.hasPrefix(" ") { value = value.dropFirst() }
        return (String(line[..<colon]), String(value))
    }
}
