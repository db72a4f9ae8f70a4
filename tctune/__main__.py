import sys

from ._namespace import namespace_error

_error = namespace_error()
if _error:  # `tctune` is a clone's root folder here, not the package: say so instead of an ImportError
    print(f"tctune: error: {_error}", file=sys.stderr)
    sys.exit(2)

from .cli import main  # noqa: E402

sys.exit(main())
