/// An example command-line chat over TreegraftKit: each answer streamed, coloured by where its tokens came from.
import Foundation
import TreegraftKit

/// Print to stderr (the chat's own notes; answers go to stdout).
func note(_ text: String) {
    FileHandle.standardError.write(Data((text + "\n").utf8))
}

/// Stream one answer to stdout; returns its text and its last chunk.
func answer(_ client: TreegraftClient, _ messages: [ChatMessage], _ arguments: Arguments) async throws -> (String, ChatChunk?) {
    var text = "", last: ChatChunk?
    for try await chunk in client.streamChat(messages: messages, options: arguments.options) {
        let shown = arguments.color ? chunk.provenance.map(Colors.paint).joined() : chunk.text
        FileHandle.standardOutput.write(Data(shown.utf8))
        text += chunk.text
        last = chunk
    }
    print()
    return (text, last)
}

func stats(_ chunk: ChatChunk?) -> String {
    guard let chunk, let usage = chunk.usage else { return "(no usage)" }
    let spec = usage.speculative
    return "\(usage.completionTokens) tokens, \(spec.steps) steps, "
        + String(format: "%.2f tokens/step, %.1f tok/s", spec.meanAccepted, spec.tokensPerSec)
}

func chat(_ client: TreegraftClient, _ arguments: Arguments) async {
    var messages: [ChatMessage] = []
    note("treegraft-chat: /reset, /quit (or end of input)")
    if arguments.color { note(Colors.legend) }
    while let line = readLine() {
        if line == "/quit" { return }
        if line == "/reset" { messages = []; note("(conversation reset)"); continue }
        messages.append(.user(line))
        do {
            let (text, last) = try await answer(client, messages, arguments)
            messages.append(.assistant(text))
            note(stats(last))
        } catch {
            messages.removeLast()
            note("error: \(error)")
        }
    }
}

do {
    let arguments = try Arguments(Array(CommandLine.arguments.dropFirst()))
    if let url = arguments.url {
        await chat(TreegraftClient(baseURL: url, apiKey: arguments.key), arguments)
    } else {
        note("starting treegraft serve ...")
        let server = try await TreegraftServer.launch(arguments: arguments.serve)
        await chat(server.client, arguments)
        server.stop()
    }
} catch {
    note("\(error)")
    exit(1)
}
