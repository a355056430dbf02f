"""`gb10d front`: one OpenAI-compatible endpoint before every gb10d instance of the machine.

core and routes: the decisions (hold or refuse while an instance starts; which routes pass, to which instance, with
which headers), pure and tested exhaustively. instances: which instances there are, from their configs. states:
what the front knows of each, from its own state file. swaps: models on demand. proxy: one request, on aiohttp's
server and client. door: the listener, the connection cap, the drain and the reload. journal: the lines it says.
pagemodel and page: the page for people at /ui/ (what it shows, decided purely; its files, data, live stream and
buttons).

May import gb10d.daemon (the control socket, status's readings, the lab) and every part below it; only the command
line imports the front.
"""
