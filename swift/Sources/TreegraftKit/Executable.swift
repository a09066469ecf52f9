/// Finding the `treegraft` command: TREEGRAFT_BIN, else the PATH.
import Foundation

/// Where `treegraft` is: `TREEGRAFT_BIN` when set, else the first executable `treegraft`
/// on `PATH`; nil (with `searched` saying where it looked) when neither has it.
public enum TreegraftExecutable {
    public static func locate(environment: [String: String] = ProcessInfo.processInfo.environment) -> URL? {
        if let bin = environment["TREEGRAFT_BIN"], !bin.isEmpty {
            return FileManager.default.isExecutableFile(atPath: bin) ? URL(fileURLWithPath: bin) : nil
        }
        for directory in (environment["PATH"] ?? "").split(separator: ":") {
            let path = "\(directory)/treegraft"
            if FileManager.default.isExecutableFile(atPath: path) { return URL(fileURLWithPath: path) }
        }
        return nil
    }

    /// Where `locate` looked, for a message saying why it found nothing.
    public static func searched(environment: [String: String] = ProcessInfo.processInfo.environment) -> String {
        if let bin = environment["TREEGRAFT_BIN"], !bin.isEmpty {
            return "TREEGRAFT_BIN=\(bin) is not an executable file"
        }
        return "no executable `treegraft` on PATH and TREEGRAFT_BIN is not set"
    }
}
