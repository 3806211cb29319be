"""kvscope inspector: a PySide6 + pyqtgraph app that draws a KV cache live or from a
recording.

Invariant: nothing here computes cache state. Sources (``inspector.sources``) apply event
batches to ``engine.events.KVState`` and hand the result to ``InspectorModel``; views
(``inspector.views``) only draw what the model holds. Importable without torch.
"""
