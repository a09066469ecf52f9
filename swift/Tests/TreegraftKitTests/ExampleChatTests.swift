/// The example app (swift/Examples/TreegraftChat) runs: it answers as the API does, coloured by source.
import XCTest
@testable import TreegraftKit

final class ExampleChatTests: XCTestCase {
    /// stdout and stderr of `treegraft-chat` against the shared server, fed `input`.
    private func run(_ server: TreegraftServer, _ flags: [String], input: String) throws -> (Int32, String, String) {
        let chat = Process()
        chat.executableURL = try Live.product("treegraft-chat")
        chat.arguments = ["--url", server.baseURL.absoluteString, "--key", server.apiKey,
                          "--max-tokens", "8"] + flags
        let stdin = Pipe(), stdout = Pipe(), stderr = Pipe()
        (chat.standardInput, chat.standardOutput, chat.standardError) = (stdin, stdout, stderr)
        try chat.run()
        stdin.fileHandleForWriting.write(Data(input.utf8))
        try stdin.fileHandleForWriting.close()
        let out = stdout.fileHandleForReading.readDataToEndOfFile()
        let err = stderr.fileHandleForReading.readDataToEndOfFile()
        chat.waitUntilExit()
        return (chat.terminationStatus, String(decoding: out, as: UTF8.self), String(decoding: err, as: UTF8.self))
    }

    func testTheChatPrintsTheAnswerTheAPIGives() async throws {
        let server = try await Live.idleServer()
        let expected = try await server.client.chat(messages: [.user("hello")], options: ChatOptions(maxTokens: 8))
        let (status, plain, notes) = try run(server, ["--no-color"], input: "hello\n")
        XCTAssertEqual(status, 0, notes)
        XCTAssertEqual(plain, expected.text + "\n")
        XCTAssertTrue(notes.contains("8 tokens, "), notes)
        let (_, coloured, _) = try run(server, [], input: "hello\n")
        let stripped = coloured.replacingOccurrences(of: "\u{1B}\\[[0-9]+m", with: "", options: .regularExpression)
        XCTAssertEqual(stripped, plain, "colouring changes only the escapes")
    }
}
