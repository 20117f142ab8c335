"""The one exception type that reaches users as a one-line message."""


class UserError(Exception):
    """A problem with the user's input (config, files, options).

    The CLI prints ``error: <message>`` on one line and exits with status 2, so the
    message must name the problem and the fix, e.g.
    ``model.preset='XXL' is not a preset; choose one of: tiny, S, B, XL``.
    """


class NotRegularFile(OSError):
    """A path names a FIFO, socket, device or folder where a file's contents are needed
    (raised by ``videodit.user_files``)."""


class FileTooLarge(OSError):
    """A file is larger than what may be read into memory for its purpose."""


def os_error_message(exc: OSError) -> str:
    """One line for a failed file operation: what happened, to which file, and what to do."""
    import errno

    if isinstance(exc, (NotRegularFile, FileTooLarge)):   # their wording carries the fix
        return f"{exc.filename} is {exc.strerror}" if isinstance(exc, NotRegularFile) else \
            f"{exc.filename} has {exc.strerror}; give a smaller file"
    what = " ".join((exc.strerror or str(exc) or type(exc).__name__).split())
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        fix = "free space on that disk or write to another one"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make it writable or choose a folder you can write to"
    elif exc.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        fix = "a file stands where a folder is needed (or the reverse); choose another path"
    elif exc.errno == errno.ENOENT:
        fix = "check the path"
    else:
        fix = "fix the problem with that file and run again"
    return f"{what}{where}; {fix}"
