package backing

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"

	"golang.org/x/sys/unix"
)

// ModelFile is one file of the model directory (config, tokenizer, shards,
// anything in a subdirectory) that the mount serves at its own path, byte
// for byte.
type ModelFile struct {
	Name     string   // slash-separated, relative to the model directory; filepath.IsLocal
	Mode     uint32   // permission bits of the file
	Identity Identity // as listed: Open refuses other bytes
	path     string   // where to open it: a symlink already resolved
}

// SkippedFile is an entry of the model directory that is not served, and why.
type SkippedFile struct {
	Name, Reason string
}

// FileSource is implemented by sources that can enumerate and open every
// file of the model directory, not only its shards.
type FileSource interface {
	// Files lists the regular files under the source, recursively, sorted
	// by name, and the entries it leaves out.
	Files() ([]ModelFile, []SkippedFile, error)
	// OpenFile opens a file that Files listed, for reads.
	OpenFile(f ModelFile) (OpenModelFile, error)
}

// OpenModelFile is a model file opened for reads.
type OpenModelFile interface {
	io.ReaderAt
	io.Closer
	// Fd is the descriptor of a local file (for FUSE passthrough), or -1.
	Fd() int
}

// MaxModelFiles bounds the files a model directory may hold: each costs an
// inode of the mount and its listing is kept in memory. A model directory
// holds tens of files; a million (a mistyped MODEL_DIR of /) is a mistake.
const MaxModelFiles = 100_000

var _ FileSource = (*LocalSource)(nil)

// Files walks the directory. Subdirectories are walked, regular files
// listed; a symlink is followed only when it resolves, through every link,
// to a regular file inside the directory (the mount never serves a file
// from elsewhere: a downloaded model's `config.json -> /etc/shadow` must not
// become readable through the mount); symlinks to directories are not
// followed (no loops, no file served twice). FIFOs, devices and sockets are
// skipped without being opened: an open of a FIFO blocks.
func (s *LocalSource) Files() ([]ModelFile, []SkippedFile, error) {
	root, err := filepath.EvalSymlinks(s.dir)
	if err != nil {
		return nil, nil, fmt.Errorf("model directory %s: %w", s.dir, err)
	}
	root, err = filepath.Abs(root)
	if err != nil {
		return nil, nil, fmt.Errorf("model directory %s: %w", s.dir, err)
	}
	var files []ModelFile
	var skipped []SkippedFile
	skip := func(name, format string, args ...any) {
		skipped = append(skipped, SkippedFile{Name: name, Reason: fmt.Sprintf(format, args...)})
	}
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if path == root {
			return err
		}
		rel, rerr := filepath.Rel(root, path)
		if rerr != nil || !filepath.IsLocal(rel) {
			return fmt.Errorf("model directory %s: %s is not inside it", s.dir, path)
		}
		name := filepath.ToSlash(rel)
		if err != nil {
			skip(name, "unreadable: %v", err)
			if d != nil && d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		if d.IsDir() {
			return nil
		}
		target := path
		if d.Type()&fs.ModeSymlink != 0 {
			if target, err = filepath.EvalSymlinks(path); err != nil {
				skip(name, "symlink that does not resolve: %v", err)
				return nil
			}
			if r, err := filepath.Rel(root, target); err != nil || !filepath.IsLocal(r) {
				skip(name, "symlink to %s, outside the model directory", target)
				return nil
			}
		}
		var st unix.Stat_t
		if err := unix.Stat(target, &st); err != nil {
			skip(name, "stat: %v", err)
			return nil
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG {
			skip(name, "%s, not a regular file", fileKind(st.Mode))
			return nil
		}
		if len(files) == MaxModelFiles {
			return fmt.Errorf("model directory %s: more than %d files: is it the model's directory?", s.dir, MaxModelFiles)
		}
		files = append(files, ModelFile{Name: name, Mode: st.Mode & 0o7777, Identity: statIdentity(&st), path: target})
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	sort.Slice(files, func(i, j int) bool { return files[i].Name < files[j].Name })
	return files, skipped, nil
}

// OpenFile opens f buffered (the backing's own readahead serves sequential
// readers) and refuses a file that is no longer the one listed: a file
// replaced or rewritten since the mount would otherwise be served with the
// size the mount announced.
func (s *LocalSource) OpenFile(f ModelFile) (OpenModelFile, error) {
	if f.path == "" {
		return nil, fmt.Errorf("model file %s: not listed by this source", f.Name)
	}
	file, err := OpenRegular(f.path, 0)
	if err != nil {
		return nil, fmt.Errorf("model file %s: %w", f.Name, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(file.Fd()), &st); err != nil {
		file.Close()
		return nil, fmt.Errorf("model file %s: %w", f.Name, err)
	}
	if id := statIdentity(&st); !id.Equal(f.Identity) {
		file.Close()
		return nil, fmt.Errorf("model file %s: %w: was %v, now %v", f.Name, ErrShardChanged, f.Identity, id)
	}
	return localModelFile{file}, nil
}

type localModelFile struct{ *os.File }

func (f localModelFile) Fd() int { return int(f.File.Fd()) }

// loadFiles lists the files of src into m, when src can.
func (m *Model) loadFiles(src Source) error {
	fsrc, ok := src.(FileSource)
	if !ok {
		return nil
	}
	files, skipped, err := fsrc.Files()
	if err != nil {
		return err
	}
	m.Files, m.SkippedFiles, m.files = files, append(m.SkippedFiles, skipped...), fsrc
	return nil
}

// OpenFile opens one of m.Files.
func (m *Model) OpenFile(f ModelFile) (OpenModelFile, error) {
	if m.files == nil {
		return nil, errors.New("model files: the source cannot open them")
	}
	return m.files.OpenFile(f)
}
