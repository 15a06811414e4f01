"""What each API the gateway speaks looks like: one ``Dialect`` per endpoint.

A dialect holds everything the request path needs to know about one API, so the path
itself stays generic (Envoy AI Gateway's ``internal/endpointspec`` is the model):

    parse              the body, validated once, into a ``Call``        (``InvalidBody``)
    prompt             the prompt as routing and the classifier see it  (``PromptView``)
    question           the text the semantic cache compares, if any
    upstream_body      what goes to the replica: model name, usage flag
    scanner            the stream's rules: framing, token events, usage, the end
    usage              the usage of a whole answer, in one normalised shape
    errors             the error envelope, and the error event of a broken stream
    answers            whether the exact cache keeps its answers, and how: the fold of a
                       stream or a JSON answer into an entry, the replay of an entry as
                       the API's JSON or events, the cache-key rules (``dialects.answer``)

``dialects.registry`` lists them all, in one place; the gateway adds a route per entry.
"""
