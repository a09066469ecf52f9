/// Reading the line `treegraft serve` prints once it listens: `serving MODEL (STRATEGY) on URL`.
import Foundation

/// The server's ready line, parsed.
public struct ReadyLine: Equatable, Sendable {
    public let model: String
    public let strategy: String
    public let url: URL

    /// The parsed line, or nil when `line` is not the ready line.
    public init?(_ line: String) {
        let words = line.trimmingCharacters(in: .whitespacesAndNewlines).split(separator: " ")
        guard words.count == 5, words[0] == "serving", words[3] == "on",
              words[2].hasPrefix("("), words[2].hasSuffix(")"),
              words[4].hasPrefix("http://"), let url = URL(string: String(words[4])),
              url.port != nil
        else { return nil }
        model = String(words[1])
        strategy = String(words[2].dropFirst().dropLast())
        self.url = url
    }
}
