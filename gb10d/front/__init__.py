"""`gb10d front`: one OpenAI-compatible endpoint before every gb10d instance of the machine.

core: the decisions (routing by `model`, hold or refuse while an instance starts), pure and tested exhaustively.
instances: which instances there are, from their configs. wire: HTTP/1.1 over asyncio streams, parsed by h11.
server: the listener and the byte pump.

May import gb10d.daemon (the control socket, status's readings, the lab) and every part below it; only the command
line imports the front.
"""
