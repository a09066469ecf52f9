/// Why TreegraftServer could not start a server.
import Foundation

/// A failed launch; each case carries the end of the server's stderr where there was one.
public enum LaunchError: Error, Equatable, Sendable, CustomStringConvertible {
    /// No `treegraft` to run; says where it looked.
    case notFound(String)
    /// The process could not be started.
    case couldNotStart(String)
    /// The server exited before it was ready.
    case exited(status: Int32, stderr: String)
    /// The server printed no ready line, or its model did not load, in time.
    case timedOut(seconds: Double, stderr: String)

    public var description: String {
        switch self {
        case .notFound(let searched): return "treegraft not found: \(searched)"
        case .couldNotStart(let why): return "could not start treegraft: \(why)"
        case .exited(let status, let stderr): return "treegraft exited with status \(status) before it was ready:\n\(stderr)"
        case .timedOut(let seconds, let stderr): return "treegraft was not ready after \(seconds) s:\n\(stderr)"
        }
    }
}
