"""The master's client side, used inside vLLM and by operators: the synchronous client, where
to find the master (locator), a node's registration kept alive (node session), what calls
return, the errors they raise and `pdxfer status`.
"""
