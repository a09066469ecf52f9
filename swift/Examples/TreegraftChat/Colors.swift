/// Terminal colours by source, as the chat page colours them: n-gram green, drafter blue, both magenta.
import TreegraftKit

enum Colors {
    /// `run` coloured for a terminal (the target's own text left plain).
    static func paint(_ run: ProvenanceRun) -> String {
        guard let code = code(run.source) else { return run.text }
        return "\u{1B}[\(code)m\(run.text)\u{1B}[0m"
    }

    static func code(_ source: Source) -> Int? {
        switch source {
        case .target: return nil
        case .ngram: return 32
        case .drafter: return 34
        case .both: return 35
        }
    }

    static let legend = "colours: " + [Source.ngram, .drafter, .both]
        .map { paint(ProvenanceRun(text: $0.rawValue, source: $0)) }.joined(separator: " ")
        + " (uncoloured: the target's own tokens)"
}
