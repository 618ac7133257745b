# `import deep_ep` -> ep_dispatcher (copied to <tmp>/shim/deep_ep/__init__.py by run_deepep_tests.sh). Python returns
# sys.modules["deep_ep"] after this file runs, which install_as_deep_ep() has just pointed at ep_dispatcher.
import ep_dispatcher

ep_dispatcher.install_as_deep_ep(force=True)
