"""The engines: starting, reaching, keeping and stopping embedded Sail, the managed Spark JVM and Spark Connect
servers, and what each can do (``capabilities``). The lake (``resources/delta/``) gets one session from here."""
