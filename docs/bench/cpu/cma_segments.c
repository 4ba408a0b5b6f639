// How much fusing a CMA receive with the addition could save (node_window.md):
// reads 3.7 MB of f32 from a forked child with process_vm_readv (what Open
// MPI's CMA single copy does) and adds it to this process's 3.7 MB, either
// all at once then the addition, or segment by segment through a small
// scratch buffer that stays in cache.
//   gcc -O3 -march=native -o cma_segments cma_segments.c
//   ./cma_segments <floats per segment> <1: cold caches, 0: warm>
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>
#include <signal.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
#define N (3700000/4)
static float *peer; static char *evict;
static void cold(){ for(size_t i=0;i<(64<<20);i+=64) evict[i]++; }
int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  int seg = argc>1? atoi(argv[1]) : 16384; // floats per segment
  int docold = argc>2? atoi(argv[2]) : 1;
  peer = aligned_alloc(64, N*4); evict = malloc(64<<20); memset(evict,0,64<<20);
  pid_t pid = fork();
  if(pid==0){ for(size_t i=0;i<N;i++) peer[i]=i*0.5f; pause(); return 0; }
  usleep(200000);
  float *mine = aligned_alloc(64,N*4), *out = aligned_alloc(64,N*4), *big = aligned_alloc(64,N*4), *scr = aligned_alloc(64, seg*4);
  for(size_t i=0;i<N;i++){mine[i]=1; out[i]=0; big[i]=0;}
  double a[40],b[40];
  for(int k=0;k<40;k++){
    if(docold) cold();
    double t=now();
    struct iovec l={big,N*4}, r={peer,N*4}; process_vm_readv(pid,&l,1,&r,1,0);
    for(size_t i=0;i<N;i++) out[i]=big[i]+mine[i];
    a[k]=now()-t;
    if(docold) cold();
    t=now();
    for(size_t s=0;s<N;s+=seg){ size_t n = N-s<seg? N-s: seg;
      struct iovec l2={scr,n*4}, r2={peer+s,n*4}; process_vm_readv(pid,&l2,1,&r2,1,0);
      for(size_t i=0;i<n;i++) out[s+i]=scr[i]+mine[s+i]; }
    b[k]=now()-t;
  }
  qsort(a,40,sizeof(double),cmp); qsort(b,40,sizeof(double),cmp);
  printf("seg %d floats cold=%d: whole then add %.3f ms, segmented fused %.3f ms (medians)\n", seg, docold, a[20], b[20]);
  kill(pid,SIGKILL); wait(0);
}
