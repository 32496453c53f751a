"""The PEP 517 build backend of engramfs-hints, in the standard library
alone (pyproject.toml: requires = []).

setuptools, the usual backend, is fetched from a package index by pip's
build isolation (so `pip install ./hints/python` failed on a node without
one) and builds in the source tree (leaving build/ and *.egg-info in the
checkout). The package is one module, so its wheel is built here: the
module, METADATA, WHEEL and RECORD, written only into the directory pip
names.
"""

import base64
import hashlib
import io
import os
import tarfile
import zipfile

NAME = 'engramfs-hints'
VERSION = '0.2.0'
SUMMARY = 'Send prefetch hints to an engramfs mount (.engramfs/control) and wait on its read barrier'
REQUIRES_PYTHON = '>=3.8'
MODULE = 'engramfs_hints.py'

_HERE = os.path.dirname(os.path.abspath(__file__))
_DIST = NAME.replace('-', '_')
_TAG = 'py3-none-any'
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed: the same sources give the same wheel
_SDIST_FILES = ('pyproject.toml', 'build_backend.py', MODULE)


def _metadata():
    return ('Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: %s\nRequires-Python: %s\n'
            % (NAME, VERSION, SUMMARY, REQUIRES_PYTHON)).encode()


def _source(name):
    with open(os.path.join(_HERE, name), 'rb') as f:
        return f.read()


def _wheel(wheel_directory, files):
    """Write a wheel of files ({archive name: bytes}) and its dist-info."""
    info = '%s-%s.dist-info' % (_DIST, VERSION)
    files = dict(files)
    files[info + '/METADATA'] = _metadata()
    files[info + '/WHEEL'] = ('Wheel-Version: 1.0\nGenerator: engramfs build_backend\n'
                              'Root-Is-Purelib: true\nTag: %s\n' % _TAG).encode()
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
        record.append('%s,sha256=%s,%d\n' % (name, digest, len(data)))
    record.append(info + '/RECORD,,\n')
    files[info + '/RECORD'] = ''.join(record).encode()
    filename = '%s-%s-%s.whl' % (_DIST, VERSION, _TAG)
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), 'w', zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            zi = zipfile.ZipInfo(name, _EPOCH)
            zi.external_attr = 0o644 << 16
            z.writestr(zi, data, zipfile.ZIP_DEFLATED)
    return filename


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {MODULE: _source(MODULE)})


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """pip install -e: a .pth that puts this directory on sys.path."""
    return _wheel(wheel_directory, {_DIST + '.pth': (_HERE + '\n').encode()})


def build_sdist(sdist_directory, config_settings=None):
    base = '%s-%s' % (_DIST, VERSION)
    filename = base + '.tar.gz'
    with tarfile.open(os.path.join(sdist_directory, filename), 'w:gz', format=tarfile.PAX_FORMAT) as tar:
        for name, data in [('PKG-INFO', _metadata())] + [(n, _source(n)) for n in _SDIST_FILES]:
            ti = tarfile.TarInfo(base + '/' + name)
            ti.size, ti.mode = len(data), 0o644
            tar.addfile(ti, io.BytesIO(data))
    return filename
