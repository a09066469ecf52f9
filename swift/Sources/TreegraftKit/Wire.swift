/// The server's JSON replies as decodable types, and their conversion to the public ones.
import Foundation

/// A streamed chunk as the server sends it (chat and text completions alike).
struct StreamChunkWire: Decodable {
    struct Choice: Decodable {
        struct Delta: Decodable { let content: String? }
        let text: String?
        let delta: Delta?
        let finishReason: String?
        enum CodingKeys: String, CodingKey { case text, delta, finishReason = "finish_reason" }
    }
    struct Extension: Decodable {
        let provenance: [ProvenanceRun]
        let tokens: Int
        let steps: Int
    }
    let choices: [Choice]
    let treegraft: Extension
    let usage: Usage?

    var chunk: ChatChunk {
        let choice = choices.first
        return ChatChunk(text: choice?.delta?.content ?? choice?.text ?? "",
                         provenance: treegraft.provenance, tokens: treegraft.tokens,
                         steps: treegraft.steps, finishReason: choice?.finishReason, usage: usage)
    }
}

/// A non-streamed reply of /v1/completions or /v1/chat/completions.
struct CompletionWire: Decodable {
    struct Choice: Decodable {
        struct Message: Decodable { let content: String }
        let text: String?
        let message: Message?
        let finishReason: String?
        enum CodingKeys: String, CodingKey { case text, message, finishReason = "finish_reason" }
    }
    let id: String
    let choices: [Choice]
    let usage: Usage

    var completion: Completion {
        let choice = choices.first
        return Completion(id: id, text: choice?.message?.content ?? choice?.text ?? "",
                          finishReason: choice?.finishReason, usage: usage)
    }
}

struct ModelListWire: Decodable {
    let data: [Model]
}
