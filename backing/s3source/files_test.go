package s3source

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/engramfs/engramfs/backing"
	"github.com/engramfs/engramfs/internal/stats"
)

// ListAll lists the fake's objects under prefix, nested keys included.
func (f *fakeStore) ListAll(ctx context.Context, prefix string) ([]objectInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var objs []objectInfo
	for k, o := range f.objects {
		if strings.HasPrefix(k, prefix) {
			objs = append(objs, objectInfo{Key: k, Size: int64(len(o.data)), ETag: o.etag})
		}
	}
	slices.SortFunc(objs, func(a, b objectInfo) int { return strings.Compare(a.Key, b.Key) })
	return objs, nil
}

// directOnly hides the fake's ListAll: a client that lists one level.
type directOnly struct{ objectClient }

func modelObjects(t *testing.T, c objectClient, f *fakeStore) (*Source, map[string][]byte) {
	t.Helper()
	rng := rand.New(rand.NewPCG(3, 4))
	shard := make([]byte, 3<<20+12345)
	for i := range shard {
		shard[i] = byte(rng.Uint32())
	}
	objs := map[string][]byte{
		"config.json":              []byte(`{"model_type": "engram"}`),
		"model-00001.safetensors":  shard,
		"original/tokenizer.model": bytes.Repeat([]byte("tok "), 3000),
		"bad//name":                []byte("x"),
	}
	for name, b := range objs {
		f.put("m/"+name, b)
	}
	f.put("other/config.json", []byte("another model"))
	src, err := newSource(c, "bucket", "m/", DefaultConfig(), &stats.Counters{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	return src, objs
}

func fileNames(files []backing.ModelFile) []string {
	var names []string
	for _, f := range files {
		names = append(names, f.Name)
	}
	return names
}

// Every object under the prefix is a file of the model, nested keys
// included; a key that is not a path inside the model is skipped with the
// reason; a client without a recursive listing gives the top level.
func TestFilesListsTheModelsObjects(t *testing.T) {
	f := newFakeStore()
	src, _ := modelObjects(t, f, f)
	files, skipped, err := src.Files()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := fileNames(files), []string{"config.json", "model-00001.safetensors", "original/tokenizer.model"}; !slices.Equal(got, want) {
		t.Errorf("files %v, want %v", got, want)
	}
	if len(skipped) != 1 || skipped[0].Name != "bad//name" {
		t.Errorf("skipped %v, want bad//name", skipped)
	}

	f2 := newFakeStore()
	src2, _ := modelObjects(t, directOnly{f2}, f2)
	files, _, err = src2.Files()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := fileNames(files), []string{"config.json", "model-00001.safetensors"}; !slices.Equal(got, want) {
		t.Errorf("one level: files %v, want %v", got, want)
	}
}

// A model file reads byte-exact: small reads in 1 MiB GETs (one per block
// read in order), a large read in one GET of exactly its bytes; an object
// rewritten since the listing is refused at open.
func TestOpenFileReadsInLargeGETs(t *testing.T) {
	f := newFakeStore()
	src, objs := modelObjects(t, f, f)
	files, _, err := src.Files()
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(files, func(mf backing.ModelFile) bool { return mf.Name == "model-00001.safetensors" })
	of, err := src.OpenFile(files[i])
	if err != nil {
		t.Fatal(err)
	}
	defer of.Close()
	if of.Fd() != -1 {
		t.Errorf("Fd %d: an object has no descriptor to pass through", of.Fd())
	}
	want := objs["model-00001.safetensors"]
	gets := len(f.getLog())
	var got bytes.Buffer
	if _, err := io.CopyBuffer(struct{ io.Writer }{&got}, io.NewSectionReader(of, 0, int64(len(want))), make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), want) {
		t.Fatal("bytes read in 4 KiB pieces differ from the object")
	}
	if n := len(f.getLog()) - gets; n != 4 {
		t.Errorf("%d GETs to read %d bytes 4 KiB at a time, want 4 (one per 1 MiB block): %v", n, len(want), f.getLog())
	}
	big := make([]byte, 2<<20)
	gets = len(f.getLog())
	if n, err := of.ReadAt(big, 12345); err != nil || n != len(big) || !bytes.Equal(big, want[12345:12345+len(big)]) {
		t.Fatalf("2 MiB at 12345: %d bytes, %v", n, err)
	}
	if log := f.getLog()[gets:]; len(log) != 1 || log[0].off != 12345 || log[0].n != int64(len(big)) {
		t.Errorf("a 2 MiB read made GETs %v, want one of exactly its bytes", log)
	}

	f.put("m/model-00001.safetensors", []byte("rewritten"))
	if _, err := src.OpenFile(files[i]); !errors.Is(err, backing.ErrShardChanged) {
		t.Fatalf("open of a rewritten object: %v, want ErrShardChanged", err)
	}
}
