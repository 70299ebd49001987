"""Prompt and sample records, and the chat-template format they were made with: what
``gen-data`` writes, ``train`` reads and ``eval``/``bench`` send. Below both ``train`` and
``bench``, so that neither imports the other for them."""
