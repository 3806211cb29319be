"""The data-parallel router: an OpenAI-compatible front over several ``kvscope serve``
replicas that picks, for each request, the replica whose prefix cache already holds the
longest prefix of its prompt (learned from each replica's event stream), balanced
against load. ``kvscope route`` runs it; ``kvscope serve --data-parallel-size N`` starts
N replicas and a router in one command."""
