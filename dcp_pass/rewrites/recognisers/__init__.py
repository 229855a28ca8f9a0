"""One module per way of writing MLA attention; each registers a `match.Recogniser`.

`match.load_recognisers` imports every module here: a new form is a new module (and its
tests), nothing else.
"""
