"""The semantic cache: embed a question, find its near neighbours, verify, share."""
