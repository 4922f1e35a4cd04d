"""Tool calling for the OpenAI chat API: the request's tools checked (request.py), the
constraint `required` or a named function puts on decoding (constraint.py), the model's
text parsed for calls by a registered parser (parsers.py, hermes.py, llama3_json.py) and
turned into `message.tool_calls` or streamed `delta.tool_calls` (output.py).

    body.tools / tool_choice / parallel_tool_calls
        -> ToolRequest (request.py)              400 naming the field otherwise
        -> chat template `tools=` (chat.py)      the model sees them
        -> SamplingParams.structured_outputs     required / named only (constraint.py)
    model text -> Extractor events (TextPart, CallStart, CallArguments)
        -> ToolDeltas: OpenAI deltas (stream) or (content, tool_calls) (whole)
"""
