/// The example chat's command line: a server to use (or launch), and the generation's options.
import Foundation
import TreegraftKit

/// `treegraft-chat [--url URL --key KEY] [--max-tokens N] [--strategy S] [--no-color]
/// [-- serve options]`: without --url it launches `treegraft serve` (options after `--`
/// go to it, e.g. `-- --model mlx-community/Qwen3-8B-4bit`).
struct Arguments {
    var url: URL?
    var key: String?
    var options = ChatOptions(maxTokens: 128)
    var color = true
    var serve: [String] = []

    init(_ words: [String]) throws {
        var rest = words[...]
        while let word = rest.popFirst() {
            switch word {
            case "--url": url = URL(string: try value(word, &rest))
            case "--key": key = try value(word, &rest)
            case "--max-tokens": options.maxTokens = Int(try value(word, &rest))
            case "--strategy": options.strategy = try value(word, &rest)
            case "--no-color": color = false
            case "--": serve = Array(rest); rest = []
            default: throw UsageError(message: "unknown option \(word)")
            }
        }
    }

    private func value(_ option: String, _ rest: inout ArraySlice<String>) throws -> String {
        guard let next = rest.popFirst() else { throw UsageError(message: "\(option) needs a value") }
        return next
    }
}

struct UsageError: Error, CustomStringConvertible {
    let message: String
    var description: String { "usage: treegraft-chat [--url URL --key KEY] [--max-tokens N] [--strategy S] [--no-color] [-- serve options]: \(message)" }
}
