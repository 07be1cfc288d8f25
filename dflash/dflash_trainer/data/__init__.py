"""The data a run reads: rows of chat or token data from any file format datasets loads, prompts and
prompt sets, the held-out split by prompt, and target features written to disk."""
