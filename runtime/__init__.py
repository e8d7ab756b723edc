"""How a Lathe service process runs, shared by the four services and the embedded stack that starts them: the gRPC
server and its one logging setup (``serving``), health and metrics (``probes``), and the shared secret between the
stack's own processes (``internal_auth``). Never imported by the client SDK, which needs none of it."""
