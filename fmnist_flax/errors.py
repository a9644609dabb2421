"""The one exception type for mistakes a user can fix; the CLI prints it as one line."""


class UserError(Exception):
    """Bad input (flags, files, directories): the message says what is wrong and how to fix it."""
