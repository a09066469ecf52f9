/// Recorded streams of `treegraft serve` (tg-tiny), edited to hold what a parser must survive.
import Foundation

enum Recorded {
    /// A chat stream as the server sent it, with a comment line, CRLF line ends on one event,
    /// and raw UTF-8 (two- three- and four-byte characters) in one chunk's text.
    static let chat = """
    : a comment line, ignored\n\
    data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tg-tiny", "choices": [{"index": 0, "finish_reason": null, "delta": {"content": "#"}}], "treegraft": {"provenance": [["#", "target"]], "tokens": 1, "steps": 0}}\n\
    \n\
    data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tg-tiny", "choices": [{"index": 0, "finish_reason": null, "delta": {"content": "é漢🙂\\n"}}], "treegraft": {"provenance": [["é漢", "ngram"], ["🙂", "both"], ["\\n", "target"]], "tokens": 3, "steps": 1}}\r\n\
    \r\n\
    data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tg-tiny", "choices": [{"index": 0, "finish_reason": "length", "delta": {"content": "\\n#"}}], "treegraft": {"provenance": [["\\n", "draft"], ["#", "target"]], "tokens": 5, "steps": 2}, "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14, "speculative": {"steps": 2, "mean_accepted": 2.0, "tokens_per_sec": 74.9, "drafter_calls": 8, "strategy": "treegraft"}}}\n\
    \n\
    data: [DONE]\n\
    \n
    """

    /// A stream whose generation failed after its first chunk: the server's error event, no [DONE].
    static let failing = """
    data: {"id": "cmpl-2", "object": "text_completion", "created": 1, "model": "tg-tiny", "choices": [{"index": 0, "finish_reason": null, "text": "ab"}], "treegraft": {"provenance": [["ab", "target"]], "tokens": 1, "steps": 0}}\n\
    \n\
    data: {"error": {"message": "generation failed: RuntimeError: device lost", "type": "server_error", "code": 500}}\n\
    \n
    """
}
