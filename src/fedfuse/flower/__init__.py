"""fedfuse on Flower: the Flower executor, the ``ServerApp``/``ClientApp`` pair and the wire format.

``pip install 'fedfuse[flower]'``; see ``docs/flower.md``.  Importing this package does not import Flower; its
modules ``executor`` (:class:`FlowerExecutor`, :class:`LocalGrid`), ``app`` (``server_app``, ``client_app``) and
``wire`` do when used.
"""
