"""The packed body, both ways: XOR against a base (:mod:`.delta`), byte planes
(:mod:`.planes`), and frames of planes each raw or zstd (:mod:`.frames`)."""
