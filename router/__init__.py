"""The HTTP front: tokenizer, prefix index, routing policies, sessions, backends."""
