/// Launches `treegraft serve` on a free port with a fresh key, waits until its model answers, and stops it.
import Foundation

/// How a server's process ended: its exit status, or the signal that ended it.
public enum ProcessExit: Equatable, Sendable {
    case exited(Int32)
    case signalled(Int32)
}

/// A local treegraft server this process started: `treegraft serve --port 0
/// --exit-on-stdin-close`, with a random API key per launch (passed in the environment, not
/// on the command line). It stops on stop() and when released, and, because it exits when
/// its stdin closes, also when this process dies.
public final class TreegraftServer: Sendable {
    /// A client for it, with its key.
    public let client: TreegraftClient
    /// Its root URL (http://127.0.0.1:PORT) and its API key.
    public let baseURL: URL
    public let apiKey: String
    private let child: ChildProcess

    /// The server's process id.
    public var processIdentifier: Int32 { child.process.processIdentifier }

    /// Whether the process is still running.
    public var isRunning: Bool { child.isRunning }

    /// How the process ended: nil while it runs.
    public var exit: ProcessExit? {
        guard !child.isRunning else { return nil }
        let status = child.process.terminationStatus
        return child.process.terminationReason == .exit ? .exited(status) : .signalled(status)
    }

    private init(child: ChildProcess, url: URL, apiKey: String) {
        self.child = child
        baseURL = url
        self.apiKey = apiKey
        client = TreegraftClient(baseURL: url, apiKey: apiKey)
    }

    /// Start a server and return once its model is loaded. `executable`: `treegraft`
    /// (default: TREEGRAFT_BIN, else PATH); `arguments`: more options of `serve` (e.g.
    /// "--model", "mlx-community/Qwen3-8B-4bit"). Throws a LaunchError.
    public static func launch(executable: URL? = nil, arguments: [String] = [],
                              timeout: TimeInterval = 300) async throws -> TreegraftServer {
        guard let executable = executable ?? TreegraftExecutable.locate() else {
            throw LaunchError.notFound(TreegraftExecutable.searched())
        }
        let key = randomKey()
        let (child, output) = try start(executable, arguments: arguments, key: key)
        let deadline = Date().addingTimeInterval(timeout)
        let ready = try await readyLine(of: child, output, until: deadline, timeout: timeout)
        let server = TreegraftServer(child: child, url: ready.url, apiKey: key)
        try await server.waitUntilLoaded(output, until: deadline, timeout: timeout)
        return server
    }

    /// Stop the server: close its stdin (it exits by itself), and terminate it if it has
    /// not gone within `grace` seconds. Returns once the process is gone.
    public func stop(grace: TimeInterval = 10) {
        child.stop(grace: grace)
    }

    // MARK: launching

    private static func start(_ executable: URL, arguments: [String], key: String) throws -> (ChildProcess, OutputLines) {
        let process = Process()
        process.executableURL = executable
        process.arguments = ["serve", "--host", "127.0.0.1", "--port", "0",
                             "--exit-on-stdin-close"] + arguments
        var environment = ProcessInfo.processInfo.environment
        environment["TREEGRAFT_API_KEY"] = key
        process.environment = environment
        let input = Pipe(), errors = Pipe()
        process.standardInput = input
        process.standardError = errors
        process.standardOutput = FileHandle.nullDevice
        do {
            try process.run()
        } catch {
            throw LaunchError.couldNotStart("\(executable.path): \(error.localizedDescription)")
        }
        return (ChildProcess(process, input: input), OutputLines(errors.fileHandleForReading))
    }

    /// The ready line, once the server printed it; fails if it exits or the deadline passes.
    private static func readyLine(of child: ChildProcess, _ output: OutputLines,
                                  until deadline: Date, timeout: TimeInterval) async throws -> ReadyLine {
        while true {
            if let ready = output.readyLine { return ready }
            if !child.isRunning {
                try await Task.sleep(nanoseconds: 100_000_000)   // the last lines of stderr
                throw LaunchError.exited(status: child.process.terminationStatus, stderr: output.text)
            }
            if Date() > deadline { throw LaunchError.timedOut(seconds: timeout, stderr: output.text) }
            try await Task.sleep(nanoseconds: 20_000_000)
        }
    }

    /// Poll /health until the model is loaded.
    private func waitUntilLoaded(_ output: OutputLines, until deadline: Date, timeout: TimeInterval) async throws {
        while true {
            if let health = try? await client.health(), health.loaded { return }
            if !child.isRunning {
                throw LaunchError.exited(status: child.process.terminationStatus, stderr: output.text)
            }
            if Date() > deadline { throw LaunchError.timedOut(seconds: timeout, stderr: output.text) }
            try await Task.sleep(nanoseconds: 50_000_000)
        }
    }

    private static func randomKey() -> String {
        var generator = SystemRandomNumberGenerator()
        return (0..<32).map { _ in String(UInt8.random(in: 0...255, using: &generator), radix: 16) }
            .map { $0.count == 1 ? "0" + $0 : $0 }.joined()
    }
}
