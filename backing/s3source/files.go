package s3source

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/engramfs/engramfs/backing"
)

// The model's other objects (config, tokenizer, the shards themselves, keys
// under "subdirectories"), served by the mount at their own paths.

// objectInfo is one object of a recursive listing.
type objectInfo struct {
	Key  string
	Size int64
	ETag string
}

// objectLister is implemented by clients that list every object under a
// prefix, nested keys included, with sizes and ETags (one LIST per 1,000
// objects, no HEAD each).
type objectLister interface {
	ListAll(ctx context.Context, prefix string) ([]objectInfo, error)
}

var (
	_ objectLister       = (*sdkClient)(nil)
	_ backing.FileSource = (*Source)(nil)
)

// ListAll lists every object under prefix: ListObjectsV2 without a
// delimiter.
func (c *sdkClient) ListAll(ctx context.Context, prefix string) ([]objectInfo, error) {
	var objs []objectInfo
	p := s3.NewListObjectsV2Paginator(c.api, &s3.ListObjectsV2Input{Bucket: &c.bucket, Prefix: &prefix})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			return nil, classify(err, "LIST "+prefix)
		}
		for _, o := range page.Contents {
			objs = append(objs, objectInfo{Key: aws.ToString(o.Key), Size: aws.ToInt64(o.Size), ETag: aws.ToString(o.ETag)})
		}
		if len(objs) > backing.MaxModelFiles {
			break // Files refuses it: no need to list the rest
		}
	}
	return objs, nil
}

// Files lists the objects under the prefix as the model's files. Keys that
// are not a relative path inside the model ("a//b", "../x", a directory
// marker ending in "/") are skipped with the reason.
func (s *Source) Files() ([]backing.ModelFile, []backing.SkippedFile, error) {
	objs, err := s.listAll()
	if err != nil {
		return nil, nil, fmt.Errorf("model %s: %w", s, err)
	}
	var files []backing.ModelFile
	var skipped []backing.SkippedFile
	for _, o := range objs {
		name, ok := strings.CutPrefix(o.Key, s.prefix)
		if !ok || name == "" {
			continue
		}
		if !validName(name) || !filepath.IsLocal(name) {
			skipped = append(skipped, backing.SkippedFile{Name: name, Reason: "not a file name inside the model"})
			continue
		}
		if len(files) == backing.MaxModelFiles {
			return nil, nil, fmt.Errorf("model %s: more than %d objects: is it the model's prefix?", s, backing.MaxModelFiles)
		}
		files = append(files, backing.ModelFile{Name: name, Mode: 0o444, Identity: backing.Identity{Size: o.Size, ETag: o.ETag}})
	}
	sort.Slice(files, func(i, j int) bool { return files[i].Name < files[j].Name })
	return files, skipped, nil
}

// listAll lists recursively where the client can; else the objects directly
// under the prefix, a HEAD each.
func (s *Source) listAll() ([]objectInfo, error) {
	ctx := context.Background()
	if l, ok := s.c.(objectLister); ok {
		return l.ListAll(ctx, s.prefix)
	}
	keys, err := s.c.List(ctx, s.prefix)
	if err != nil {
		return nil, err
	}
	objs := make([]objectInfo, 0, len(keys))
	for _, k := range keys {
		size, etag, err := s.c.Head(ctx, k)
		if err != nil {
			return nil, err
		}
		objs = append(objs, objectInfo{Key: k, Size: size, ETag: etag})
	}
	return objs, nil
}

// OpenFile opens a listed object: a HEAD, refused when the object is no
// longer the one listed. Reads are GETs conditional on its ETag, of at least
// fileBlock bytes: FUSE asks a page at a time until the daemon's readahead
// starts, and a 4 KiB GET costs as much as a 1 MiB one.
func (s *Source) OpenFile(f backing.ModelFile) (backing.OpenModelFile, error) {
	sh, err := s.open(f.Name, false)
	if err != nil {
		return nil, err
	}
	if sh.id.Size != f.Identity.Size || strings.Trim(sh.id.ETag, `"`) != strings.Trim(f.Identity.ETag, `"`) {
		sh.Close()
		return nil, fmt.Errorf("%s: %w: was %v, now %v", sh.url(), backing.ErrShardChanged, f.Identity, sh.id)
	}
	return &objectFile{sh: sh}, nil
}

// fileBlock is the smallest GET of a model file.
const fileBlock = 1 << 20

// objectFile is an open object of the model, with the last block read kept
// for the small reads that follow it.
type objectFile struct {
	sh *shard

	mu       sync.Mutex
	blockOff int64  // GUARDED_BY(mu)
	block    []byte // GUARDED_BY(mu); nil: none yet
}

func (o *objectFile) Fd() int      { return -1 }
func (o *objectFile) Close() error { return o.sh.Close() }

// ReadAt reads p at off: a read of a block or more is one GET of exactly
// those bytes; a smaller one comes from the block that holds it.
func (o *objectFile) ReadAt(p []byte, off int64) (int, error) {
	size := o.sh.id.Size
	if off >= size {
		return 0, io.EOF
	}
	if len(p) >= fileBlock {
		return o.sh.ReadAt(p, off)
	}
	n := 0
	for n < len(p) && off+int64(n) < size {
		at := off + int64(n)
		b, bo, err := o.blockAt(at)
		if err != nil {
			return n, err
		}
		n += copy(p[n:], b[at-bo:])
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// blockAt returns the block that holds off, and its offset.
func (o *objectFile) blockAt(off int64) ([]byte, int64, error) {
	start := off - off%fileBlock
	o.mu.Lock()
	if o.block != nil && o.blockOff == start {
		b := o.block
		o.mu.Unlock()
		return b, start, nil
	}
	o.mu.Unlock()
	b := make([]byte, min(fileBlock, o.sh.id.Size-start))
	if _, err := o.sh.ReadAt(b, start); err != nil && err != io.EOF {
		return nil, 0, err
	}
	o.mu.Lock()
	o.block, o.blockOff = b, start
	o.mu.Unlock()
	return b, start, nil
}
