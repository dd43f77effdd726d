"""`python -m kiln.engine.core`: the engine-core process, as the API server starts it (`kiln.engine.core.process`)."""

from kiln.engine.core.process import main

main()
