"""The bundled GLM-5.3-Flash runner (config, checkpoint loader, layers, paged cache, engine) and the
cold/warm verifier. It consumes kvoffload through the same public API a user would."""
