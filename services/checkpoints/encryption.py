"""Age encryption of exported files (Tinker's ``age_encryption_recipients``), with ``pyrage``.

Owns the parsing of the recipients a caller names and the encryption to them; ``CheckpointService.export`` calls it
and names each encrypted file ``<file>.age``. ``pyrage`` is imported only when an export asks for encryption.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lathe.errors import InvalidArgument


def age_encrypter(recipients: Sequence[str]) -> Callable[[bytes], bytes]:
    """Encrypt to every one of ``recipients`` (age "age1..." keys or SSH public keys) with ``pyrage``."""
    import pyrage

    parsed = []
    for i, r in enumerate(recipients):
        kind = pyrage.ssh if r.startswith(("ssh-", "ecdsa-")) else pyrage.x25519
        try:
            parsed.append(kind.Recipient.from_str(r))
        except pyrage.RecipientError as e:
            raise InvalidArgument(f"age_recipients[{i}] = {r[:24]!r}... is not an age or SSH public key: {e}") from None
    return lambda data: pyrage.encrypt(data, parsed)
